"""MkDocs hook: pages and figures generated at build time from the code and the measurements.

- ``reference/engine-args.md``: every engine argument, from the typed config (`pagedllm.config`);
- ``reference/cli.md``: every command and flag, from the CLI's own argparse parser;
- ``img/ratios.svg``: the benchmark ratios chart, from ``benchmarks/results/*.json``.

Nothing here is written into ``docs/``: the files exist only in the built site, so they cannot drift
from what they describe.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import json
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for uri, content in (
        ("reference/engine-args.md", engine_args_page()),
        ("reference/cli.md", cli_page()),
        ("img/ratios.svg", ratios_svg(load_comparisons())),
    ):
        files.append(File.generated(config, uri, content=content))
    return files


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if value is dataclasses.MISSING or value is argparse.SUPPRESS:
        return ""
    return f"`{value!r}`" if value is not None else "`None`"


def engine_args_page() -> str:
    from pagedllm.config import _SECTIONS, EngineConfig

    out = [
        "# Engine arguments",
        "",
        "Generated from `pagedllm/config.py`, the single source of truth: each argument is a keyword of "
        "`LLM(...)` and a flag of `pagedllm serve` / `pagedllm generate` (`--max-model-len` for "
        "`max_model_len`; booleans also take `--no-...`).",
        "",
    ]
    for section, cls in _SECTIONS.items():
        out += [f"## {cls.__name__} (`{section}`)", "", "| argument | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            choices = EngineConfig.choices(section, f.name)
            hint = EngineConfig.field_type(section, f.name)
            typ = " / ".join(f"`{c!r}`" for c in choices) if choices else f"`{getattr(hint, '__name__', hint)}`"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            out.append(
                f"| `{f.name}` | {_cell(typ)} | {_cell(_default(default))} | {_cell(f.metadata.get('help', ''))} |"
            )
        out.append("")
    return "\n".join(out)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((name, sub))
    return found


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
        choices = " / ".join(f"`{c}`" for c in action.choices) if action.choices else ""
        rows.append(f"| {names} | {_cell(choices)} | {_cell(_default(action.default))} | {_cell(action.help or '')} |")
    return rows


def cli_page() -> str:
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.cli import build_parser

    engine_flags = {"--" + f.name.replace("_", "-") for _, f in EngineConfig.all_fields()}
    out = [
        "# Command line",
        "",
        "Generated from the `pagedllm` command's own parser (`pagedllm/entrypoints/cli.py`). Commands that "
        "load a model also take every [engine argument](engine-args.md) as a flag; those are listed once, "
        "there, and not repeated below.",
        "",
    ]

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        subs = _subcommands(parser)
        own = [
            a
            for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and not (set(a.option_strings) & engine_flags)
            and a.dest != "model_pos"
        ]
        takes_engine = any(set(a.option_strings) & engine_flags for a in parser._actions)
        out.extend([f"## `{prefix}`", ""])
        if parser.description:
            out.extend([parser.description, ""])
        if takes_engine:
            out.extend(["Takes the [engine arguments](engine-args.md) as flags.", ""])
        if own:
            trimmed = argparse.ArgumentParser(add_help=False)
            trimmed._actions = own
            out.extend(["| flag | choices | default | meaning |", "|---|---|---|---|", *_flag_rows(trimmed), ""])
        for name, sub in subs:
            walk(f"{prefix} {name}", sub)

    walk("pagedllm", build_parser())
    return "\n".join(out)


def load_comparisons() -> list[dict]:
    """Every comparison in benchmarks/results/*.json, oldest file first."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        for c in doc["comparisons"]:
            rows.append({**c, "date": doc["date"], "machine": doc["machine"]})
    if not rows:
        raise ValueError(f"no benchmark comparisons under {RESULTS}")
    return rows


def ratio(c: dict) -> float:
    """pagedllm's advantage: above 1 it is faster (or smaller) than the peer."""
    p, q = float(c["pagedllm"]), float(c["peer_value"])
    return p / q if c["higher_is_better"] else q / p


def ratios_svg(rows: list[dict]) -> str:
    """A horizontal bar per comparison, on a log scale centred on 1 (level with the peer)."""
    import math

    label_w, bar_w, row_h, top = 400, 360, 24, 46
    lo, hi = math.log(1 / 12), math.log(12)
    height = top + row_h * len(rows) + 30

    def x(r: float) -> float:
        return label_w + bar_w * (min(max(math.log(r), lo), hi) - lo) / (hi - lo)

    palette = ["#4c72b0", "#dd8452", "#55a868", "#8172b3"]
    colours = {peer: palette[i % len(palette)] for i, peer in enumerate(dict.fromkeys(c["peer"] for c in rows))}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 80}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        '<text x="8" y="18" font-size="14" font-weight="bold">pagedllm against its peers '
        "(above 1×: pagedllm faster or smaller; log scale; dates in docs/benchmarks.md)</text>",
    ]
    for tick in (1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8):
        tx = x(tick)
        label = f"{tick:g}×" if tick >= 1 else f"1/{round(1 / tick)}×"
        parts.append(f'<line x1="{tx:.1f}" y1="{top - 8}" x2="{tx:.1f}" y2="{height - 24}" stroke="#ddd"/>')
        parts.append(f'<text x="{tx:.1f}" y="{top - 12}" text-anchor="middle" fill="#666">{label}</text>')
    one = x(1)
    for i, c in enumerate(rows):
        r = ratio(c)
        y = top + i * row_h
        colour = colours[c["peer"]]
        x0, x1 = sorted((one, x(r)))
        label = html.escape(f"{c['model']}: {c['name']}")
        parts.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{label}</text>')
        parts.append(
            f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(x1 - x0, 1):.1f}" height="{row_h - 8}" fill="{colour}">'
            f"<title>{html.escape(c['command'] + ' (' + c['date'] + ')')}</title></rect>"
        )
        parts.append(f'<text x="{max(x1, one) + 4:.1f}" y="{y + 15}">{r:.2f}×</text>')
    parts.append(f'<line x1="{one:.1f}" y1="{top - 8}" x2="{one:.1f}" y2="{height - 24}" stroke="#333"/>')
    legend_x = 8
    for peer, colour in colours.items():
        parts.append(f'<rect x="{legend_x}" y="{height - 18}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{legend_x + 14}" y="{height - 9}">{peer}</text>')
        legend_x += 110
    parts.append("</svg>")
    return "\n".join(parts)
