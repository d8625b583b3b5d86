"""Image input on LLaVA-style checkpoints: SmolLM2-135M's real text weights joined to a CLIP tower and projector
with seeded random weights (``benchmarks/vision_models.py``), against transformers' ``LlavaForConditionalGeneration``
on the same directory and the same images.

The comparison checks the whole path (processing, tower, projector, merging into the prompt, decoding); it
cannot check that an answer describes an image: the tower's weights are random.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidParameterError

from utils import (
    MODEL,
    Server,
    benchmark_module,
    check_engine_clean,
    check_greedy_close,
    check_outputs_unchanged,
    hf_greedy,
    noise_image,
)

PIL = pytest.importorskip("PIL.Image")

TOPK = 5
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=TOPK, ignore_eos=True)
IMAGE_TOKEN_ID = 49152  # "<image>", added after SmolLM2's 49152 tokens
SIZES = [(50, 80), (64, 64), (120, 90), (33, 200), (300, 240)]  # (height, width): smaller, equal, larger


def _data_url(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


@pytest.fixture(scope="module")
def llava_dir(module_tmp: Any, smollm2_text_model: Any) -> str:
    vm = benchmark_module("vision_models")
    return str(vm.build_llava(module_tmp("llava"), text_model=smollm2_text_model))


@pytest.fixture(scope="module")
def hf(llava_dir: str) -> tuple[Any, Any]:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


IMAGES = [noise_image(i, size) for i, size in enumerate(SIZES)]


def _chat(processor: Any, num_images: int, question: str) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": question}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def _batch(processor: Any) -> list[tuple[str, list[Any]]]:
    """Text-only prompts beside prompts with 1 to 3 images of different sizes (one image twice)."""
    return [
        (_chat(processor, 1, "What is in this picture?"), IMAGES[:1]),
        (_chat(processor, 0, "Write a haiku about the sea."), []),
        (_chat(processor, 2, "Compare these two pictures."), IMAGES[1:3]),
        (_chat(processor, 3, "Describe all three in one line each."), [IMAGES[3], IMAGES[4], IMAGES[0]]),
        ("Once upon a time", []),
        (_chat(processor, 1, "Is this the same picture as before?"), IMAGES[2:3]),
    ]


def _inputs(batch: list[tuple[str, list[Any]]]) -> list[Any]:
    return [{"prompt": t, "multi_modal_data": {"image": im}} if im else t for t, im in batch]


@pytest.fixture(scope="module")
def reference(llava_dir: str, hf: tuple[Any, Any]) -> tuple[list[Any], Any]:
    """Our outputs with every scheduler feature off and room for the whole batch in one step."""
    llm = LLM(llava_dir, max_model_len=1024, enable_prefix_caching=False, enable_chunked_prefill=False)
    outs = llm.generate(_inputs(_batch(hf[1])), GREEDY, use_tqdm=False)
    check_engine_clean(llm)
    return outs, llm


def test_llava_greedy_matches_transformers_on_images_of_every_size(hf: tuple[Any, Any], reference: Any) -> None:
    model, processor = hf
    outs, _ = reference
    batch = _batch(processor)
    ids, extra = [], []
    for (text, images), out in zip(batch, outs):
        inp = processor(text=text, images=images or None, return_tensors="pt")
        ids.append(inp["input_ids"][0].tolist())
        extra.append({"pixel_values": inp["pixel_values"]} if images else {})
        # the same placeholders as the HF processor's: as many image tokens, in the same places
        assert list(out.prompt_token_ids) == ids[-1]
        assert ids[-1].count(IMAGE_TOKEN_ID) == 64 * len(images)
    ref = hf_greedy(model, ids, max_new_tokens=16, topk=TOPK, first_inputs=extra)
    result = check_greedy_close(
        ref, [o.outputs[0] for o in outs], TOPK, logprob_atol=1e-4, min_exact_fraction=1.0, names=("hf", "ours")
    )
    assert result.max_logprob_diff < 1e-4


def test_token_id_prompts_and_chat_parts_give_the_same_tokens(hf: tuple[Any, Any], reference: Any) -> None:
    """One image token per image in ``prompt_token_ids`` is expanded like the processor's text; ``LLM.chat``
    takes vLLM's ``image_pil`` and ``image_url`` parts."""
    processor = hf[1]
    outs, llm = reference
    text, images = _batch(processor)[2]
    short = processor.tokenizer.encode(text, add_special_tokens=False)
    assert short.count(IMAGE_TOKEN_ID) == 2
    by_ids = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    chat = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_pil", "image_pil": images[0]},
                    {"type": "image_url", "image_url": {"url": _data_url(images[1])}},
                    {"type": "text", "text": "Compare these two pictures."},
                ],
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    for got in (by_ids[0], chat[0]):
        assert list(got.prompt_token_ids) == list(outs[2].prompt_token_ids)
        assert got.outputs[0].token_ids == outs[2].outputs[0].token_ids
    check_engine_clean(llm)


def test_chunked_prefill_preemption_prefix_caching_and_n_leave_outputs_unchanged(
    llava_dir: str, hf: tuple[Any, Any], reference: Any
) -> None:
    batch = _inputs(_batch(hf[1]))
    ref = reference[0]

    # chunks of 32 tokens: every image spans several chunks, and the encoder cache holds one image at a time
    chunked = LLM(llava_dir, max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=32)
    check_outputs_unchanged(ref, chunked.generate(batch, GREEDY, use_tqdm=False))
    check_engine_clean(chunked)
    del chunked

    # too few blocks for the batch: requests are preempted and computed again
    tight = LLM(
        llava_dir,
        max_model_len=384,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=24,
    )
    check_outputs_unchanged(ref, tight.generate(batch, GREEDY, use_tqdm=False))
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    check_engine_clean(tight)
    del tight

    # prefix caching, twice over (the second pass from the cache), with a large encoder cache: each distinct
    # image is encoded once, whatever the chunks, the second pass and the n=2 siblings
    cached = LLM(llava_dir, max_model_len=1024, max_num_batched_tokens=48, encoder_cache_size=4096)
    check_outputs_unchanged(ref, cached.generate(batch, GREEDY, use_tqdm=False))
    again = cached.generate(batch, GREEDY, use_tqdm=False)
    check_outputs_unchanged(ref, again)
    assert all(o.num_cached_tokens > 0 for o, (_, im) in zip(again, _batch(hf[1])) if im)
    two = cached.generate(batch[:1], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4), use_tqdm=False)
    assert len(two[0].outputs) == 2
    assert cached.llm_engine.core.scheduler.encoder_cache.num_encoded == len(IMAGES)
    check_engine_clean(cached)


def test_the_encoder_budget_spreads_images_over_steps_while_decodes_go_on(llava_dir: str, hf: tuple[Any, Any]) -> None:
    """One image's tokens a step (max_num_encoder_input_tokens=64): a prompt of three images is encoded over three
    steps, its chunks stopping before an image the step cannot encode, and a running decode gets a token in
    every one of them."""
    llm = LLM(llava_dir, max_model_len=1024, max_num_batched_tokens=512, max_num_encoder_input_tokens=64)
    engine = llm.llm_engine
    runner = engine.core.runner
    engine.add_request("talk", "Once upon a time", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    engine.step()  # its prompt: decoding from the next step on
    text = _chat(hf[1], 3, "Describe all three.")
    engine.add_request("look", {"prompt": text, "multi_modal_data": {"image": IMAGES[:3]}}, GREEDY)
    encoded, talked = [], []
    while "look" in engine.core.scheduler.requests and not engine.core.scheduler.requests["look"].first_token_time:
        before, tokens = runner.num_encoder_tokens, len(runner.states["talk"].token_ids)
        engine.step()
        encoded.append(runner.num_encoder_tokens - before)
        talked.append(len(runner.states["talk"].token_ids) - tokens)
    assert encoded == [64, 64, 64], encoded
    assert all(n == 1 for n in talked), talked
    llm._drain()
    while engine.has_unfinished_requests():
        engine.step()
    check_engine_clean(llm)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}], ids=["tp3", "pp2"])
def test_tensor_and_pipeline_parallelism_give_one_process_tokens(
    llava_dir: str, hf: tuple[Any, Any], reference: Any, parallel: dict
) -> None:
    """Every rank holds the tower (tp: each encodes the step's images itself); under pp only the first stage
    does, and embeds."""
    outs, _ = reference
    llm = LLM(llava_dir, max_model_len=1024, enable_prefix_caching=False, num_gpu_blocks_override=128, **parallel)
    try:
        got = llm.generate(_inputs(_batch(hf[1]))[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids[:8] for o in outs[:3]]
    finally:
        llm.llm_engine.shutdown()


def test_prefix_cache_reuses_an_image_and_never_shares_another(llava_dir: str, hf: tuple[Any, Any]) -> None:
    processor = hf[1]
    llm = LLM(llava_dir, max_model_len=1024)
    question = "Look at this picture closely and then tell me, in as much detail as you can, " * 6
    text = _chat(processor, 1, question)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False)[0]
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[0]}}, GREEDY, use_tqdm=False)[0]
    other = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": noise_image(99, (64, 64))}}, GREEDY, use_tqdm=False
    )[0]
    n = len(first.prompt_token_ids)
    assert same.num_cached_tokens >= 0.9 * n
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    image_at = list(first.prompt_token_ids).index(IMAGE_TOKEN_ID)
    assert other.num_cached_tokens <= image_at  # not one block that holds part of the image
    assert (
        other.outputs[0].token_ids != first.outputs[0].token_ids
        or other.outputs[0].logprobs != first.outputs[0].logprobs
    )
    check_engine_clean(llm)


def test_bad_images_are_refused_by_name_and_the_engine_serves_on(
    llava_dir: str, hf: tuple[Any, Any], reference: Any, tmp_path: Any
) -> None:
    outs, llm = reference
    text = _chat(hf[1], 1, "What is this?")
    png = _data_url(IMAGES[0])
    raw = base64.b64decode(png.split(",", 1)[1])
    tiff = io.BytesIO()
    IMAGES[0].save(tiff, format="TIFF")
    cases = {
        "not an image": b"hello, I am not a picture",
        "truncated": raw[: len(raw) // 2],
        "unsupported format": tiff.getvalue(),
        "too many pixels": PIL.new("RGB", (5000, 4000)),
        "bad base64": "data:image/png;base64,@@@@",
        "not allowed domain": "https://example.com/cat.png",
        "file not allowed": f"file://{tmp_path}/x.png",
        "unknown scheme": "ftp://example.com/cat.png",
    }
    for what, image in cases.items():
        with pytest.raises(InvalidParameterError) as e:
            llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        assert e.value.param.startswith("multi_modal_data.image"), (what, e.value)
    with pytest.raises(InvalidParameterError, match="limit_mm_per_prompt"):
        llm.generate({"prompt": _chat(hf[1], 5, "Many."), "multi_modal_data": {"image": IMAGES}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="placeholders do not match"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": IMAGES[:2]}}, GREEDY)
    with pytest.raises(InvalidParameterError, match="no image"):
        llm.generate(text, GREEDY)
    with pytest.raises(InvalidParameterError, match="unsupported modality"):
        llm.generate({"prompt": text, "multi_modal_data": {"video": IMAGES[0]}}, GREEDY)
    # still serving, every block back
    again = llm.generate(_inputs(_batch(hf[1]))[:1], GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    check_engine_clean(llm)


def test_a_text_only_model_refuses_images(tiny_model_factory: Any) -> None:
    llm = LLM(str(tiny_model_factory("llama")), max_model_len=256, num_gpu_blocks_override=32)
    with pytest.raises(InvalidParameterError, match="text-only model") as e:
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    assert e.value.param == "multi_modal_data"


def test_siglip_tower_over_another_text_model_matches_transformers(tmp_path: Path, tiny_model_factory: Any) -> None:
    """SigLIP (no class token, "full" features) over a tiny Qwen2 (q/k/v biases): the tower and the text class
    are each the registry's, whatever the pair."""
    from transformers import AutoModelForCausalLM, AutoProcessor, LlavaForConditionalGeneration

    text = AutoModelForCausalLM.from_pretrained(tiny_model_factory("qwen2"), dtype=torch.float32)
    path = str(
        benchmark_module("vision_models").build_llava(tmp_path / "llava-siglip", text_model=text, vision="siglip")
    )
    processor = AutoProcessor.from_pretrained(path)
    batch = [(_chat(processor, 1, "What is it?"), IMAGES[4:5]), (_chat(processor, 2, "And these?"), IMAGES[:2])]
    llm = LLM(path, max_model_len=512, num_gpu_blocks_override=64)
    outs = llm.generate(_inputs(batch), GREEDY, use_tqdm=False)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ids, extra = [], []
    for (t, images), out in zip(batch, outs):
        inp = processor(text=t, images=images, return_tensors="pt")
        ids.append(inp["input_ids"][0].tolist())
        extra.append({"pixel_values": inp["pixel_values"]})
        assert list(out.prompt_token_ids) == ids[-1]
    ref = hf_greedy(model, ids, max_new_tokens=16, topk=TOPK, first_inputs=extra)
    check_greedy_close(ref, [o.outputs[0] for o in outs], TOPK, logprob_atol=1e-4, min_exact_fraction=1.0)


class _Pictures:
    """A local HTTP server of images: ``/<delay seconds>/<name>.png``, ``/big.png`` (200 kB), anything else 404."""

    def __init__(self) -> None:
        import http.server
        import threading
        import time

        png = base64.b64decode(_data_url(IMAGES[0]).split(",", 1)[1])

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                if parts == ["trickle.png"]:  # a byte every 0.2 s: each read is quick, the whole fetch is not
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(png)))
                    self.end_headers()
                    try:
                        for b in png[:50]:
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:
                        pass
                    return
                encoding = None
                if parts == ["big.png"]:
                    body = png + b"\0" * 200_000
                elif parts == ["gz.png"]:  # 20 MB of zeros in 20 kB
                    import gzip

                    body, encoding = gzip.compress(png + b"\0" * 20_000_000), "gzip"
                elif len(parts) == 2 and parts[1].endswith(".png"):
                    time.sleep(float(parts[0]))
                    body = png
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                if encoding:
                    self.send_header("Content-Encoding", encoding)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the client gave up (a timeout)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def test_reading_images_keeps_to_the_limits(tmp_path: Any) -> None:
    """The media reader alone: files only under the allowed folder and only regular ones, fetches within the
    whole-fetch deadline and the byte limit as sent (no decompression), malformed URLs as errors naming the
    field."""
    import os

    from pagedllm.config import MultiModalSection
    from pagedllm.multimodal.media import load_image

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    IMAGES[0].save(allowed / "ok.png")
    IMAGES[0].save(tmp_path / "secret.png")
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    os.mkfifo(allowed / "fifo.png")
    pictures = _Pictures()
    config = MultiModalSection(
        allowed_local_media_path=str(allowed),
        allowed_media_domains="127.0.0.1",
        media_fetch_timeout=1.0,
        max_image_bytes=100_000,
    )
    try:
        assert load_image(f"file://{allowed}/ok.png", config, "f").size == IMAGES[0].size
        assert load_image(f"{pictures.url}/0/ok.png", config, "f").size == IMAGES[0].size
        for url, why in (
            (f"file://{allowed}/link.png", "outside the allowed local media path"),
            (f"file://{allowed}/fifo.png", "not a regular file"),
            (f"file://{allowed}", "not a regular file"),
            (f"file://{allowed}/missing.png", "cannot read"),
            (f"file://{allowed}/a%00b.png", "NUL"),
            (f"{pictures.url}/trickle.png", "took longer than 1.0 s"),
            (f"{pictures.url}/gz.png", "Content-Encoding 'gzip'"),
            ("http://[::1", "not a valid URL"),
            ("http://127.0.0.1:99999/x.png", "not a valid URL"),
        ):
            with pytest.raises(InvalidParameterError, match=why) as e:
                load_image(url, config, "f")
            assert e.value.param == "f"
    finally:
        pictures.close()


def test_without_chunked_prefill_a_prompts_images_must_fit_one_step(llava_dir: str, hf: tuple[Any, Any]) -> None:
    llm = LLM(
        llava_dir,
        max_model_len=1024,
        enable_chunked_prefill=False,
        max_num_batched_tokens=1024,
        max_num_encoder_input_tokens=128,
        num_gpu_blocks_override=128,
    )
    two = {"prompt": _chat(hf[1], 2, "Compare."), "multi_modal_data": {"image": IMAGES[:2]}}
    assert llm.generate(two, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    three = {"prompt": _chat(hf[1], 3, "Compare."), "multi_modal_data": {"image": IMAGES[:3]}}
    with pytest.raises(InvalidParameterError, match="take 192 tokens, more than one step's encoder budget"):
        llm.generate(three, GREEDY, use_tqdm=False)
    check_engine_clean(llm)


def test_server_answers_images_sent_as_data_urls(llava_dir: str, reference: Any, tmp_path: Any) -> None:
    from openai import BadRequestError, OpenAI

    want = reference[0][2]  # two images and a question, offline
    pictures = _Pictures()
    IMAGES[0].save(tmp_path / "local.png")
    server = Server(
        llava_dir,
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "256",
        "--allowed-media-domains",
        "127.0.0.1",
        "--media-fetch-timeout",
        "2",
        "--max-image-bytes",
        "100000",
        "--allowed-local-media-path",
        str(tmp_path),
    )
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        def ask(fmt: str) -> list[dict[str, Any]]:
            images = [{"type": "image_url", "image_url": {"url": _data_url(im, fmt)}} for im in IMAGES[1:3]]
            return [{"role": "user", "content": [*images, {"type": "text", "text": "Compare these two pictures."}]}]

        kw: dict[str, Any] = dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
        resp = client.chat.completions.create(messages=ask("PNG"), **kw)  # PNG: the offline run's very pixels
        assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
        assert resp.choices[0].message.content == want.outputs[0].text
        stream = client.chat.completions.create(messages=ask("PNG"), stream=True, **kw)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.outputs[0].text
        jpeg = client.chat.completions.create(messages=ask("JPEG"), **kw)  # other pixels, the same placeholders
        assert jpeg.usage.prompt_tokens == len(want.prompt_token_ids) and jpeg.usage.completion_tokens == 16
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(BadRequestError, match="image"):
            client.chat.completions.create(model=MODEL, messages=bad, max_tokens=4)
        assert client.chat.completions.create(messages=ask("PNG"), **kw).choices[0].message.content  # serving on
        # encoder work in /metrics and the dashboard's feed: 4 distinct images encoded (2 PNG, 2 JPEG). A PNG
        # request after the first gets its prompt from the prefix cache but for the last block, which holds the
        # second image's last tokens: that image is looked up again, and found in the encoder cache
        import httpx

        assert server.metric("pagedllm:encoder_images_total") == 4
        assert server.metric("pagedllm:encoder_tokens_total") == 4 * 64
        assert server.metric("pagedllm:mm_cache_queries_total") == 4 + 2
        assert server.metric("pagedllm:mm_cache_hits_total") == 2
        totals = httpx.get(f"{server.url}/v1/engine/state").json()["totals"]
        assert totals["encoder_images"] == 4 and totals["mm_cache_hits"] == 2

        def one(url: str) -> Any:
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ]
            return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kw)

        # an allowed host's URL is fetched, and a local file under the allowed folder read: the same pixels
        fetched, local = one(f"{pictures.url}/0/cat.png"), one(f"file://{tmp_path}/local.png")
        assert fetched.choices[0].message.content == local.choices[0].message.content == reference[0][0].outputs[0].text
        # a slow fetch holds up no other request: a text request sent after it finishes first
        import concurrent.futures
        import time

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(lambda: (one(f"{pictures.url}/1.5/slow.png"), time.monotonic()))
            time.sleep(0.3)
            text = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw)
            text_done = time.monotonic()
            assert text.choices[0].message.content and slow.result()[1] > text_done
        for url, why in (
            (f"{pictures.url}/5/late.png", "fetching the image failed"),  # past --media-fetch-timeout
            (f"{pictures.url}/big.png", "larger than 100000 bytes"),
            (f"{pictures.url}/nothing", "HTTP 404"),
            (pictures.url.replace("127.0.0.1", "localhost") + "/0/cat.png", "does not fetch images from 'localhost'"),
            (f"file://{tmp_path}/../outside.png", "outside the allowed local media path"),
        ):
            with pytest.raises(BadRequestError, match=why):
                one(url)
    finally:
        server.stop()
        pictures.close()


def test_decoded_images_in_flight_stay_within_the_pixel_budget(llava_dir: str, hf: tuple[Any, Any]) -> None:
    """Twelve concurrent requests of up to three images sent as bytes: the pixels decoded at once never exceed
    max_pixels_in_flight (room for two images at the pixel limit), every request is answered with the tokens it
    gets alone, and the budget is whole again after. (Without it, 12 such requests decoded 48 images at once.)"""
    import asyncio

    from pagedllm.engine.async_llm import AsyncLLM

    limit = 300 * 240
    batch = [(t, im) for t, im in _batch(hf[1]) if im] * 3

    def as_bytes(image: Any) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    prompts = [{"prompt": t, "multi_modal_data": {"image": [as_bytes(i) for i in im]}} for t, im in batch]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = LLM(llava_dir, max_model_len=1024).generate(prompts[:4], params, use_tqdm=False)
    llm = AsyncLLM.from_kwargs(
        model=llava_dir, max_model_len=1024, max_image_pixels=limit, max_pixels_in_flight=2 * limit
    )

    async def run() -> tuple[list[Any], int]:
        peak, done = 0, False

        async def watch() -> None:
            nonlocal peak
            while not done:
                assert llm._pixels is not None
                peak = max(peak, llm._pixels.used)
                await asyncio.sleep(0)

        async def one(i: int, prompt: Any) -> Any:
            last = None
            async for out in llm.generate(prompt, params, request_id=f"r{i}"):
                last = out
            return last

        watcher = asyncio.ensure_future(watch())
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        done = True
        await watcher
        return outs, peak

    try:
        outs, peak = asyncio.run(run())
        assert 0 < peak <= 2 * limit
        assert llm._pixels is not None and llm._pixels.used == 0
        assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in alone]
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    finally:
        llm.shutdown()


def test_a_request_that_finds_no_room_for_its_images_is_told_to_retry() -> None:
    import asyncio

    from pagedllm.engine.async_llm import PixelBudget
    from pagedllm.errors import QueueFullError

    budget = PixelBudget(10, wait_s=0.1)

    async def run() -> None:
        await budget.acquire(8)
        with pytest.raises(QueueFullError, match="retry later") as e:
            await budget.acquire(5)
        assert e.value.param == "max_pixels_in_flight"
        budget.release(8)
        await budget.acquire(10)  # room again once the first gave it back

    asyncio.run(run())
    assert budget.used == 10
