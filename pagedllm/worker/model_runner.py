"""Turns a SchedulerOutput into one flattened batch, runs the model, samples (or, as a pooling runner, pools).

Per-request state (known token ids, block ids, sampling settings) persists here
across steps and is updated from the scheduler's deltas; each step only gathers
the new tokens. The batch is ordered decodes first so the attention backend can
run all one-token queries as one batched call.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from pagedllm.attention.torch_ref import copy_blocks
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.distributed import ParallelState
from pagedllm.sample import Penalties, Sampler, SamplingBatch
from pagedllm.sample.rejection import verify
from pagedllm.sample.sampler import SamplerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.config import HEADS
from pagedllm.spec_decode.proposer import ProposeContext
from pagedllm.worker.batch import Segment, build_batch
from pagedllm.worker.runner_output import ModelRunnerOutput, SampleLogprobs

if TYPE_CHECKING:
    from pagedllm.engine.pooling import PoolingConfig
    from pagedllm.kv_transfer.mooncake import MooncakeWorker
    from pagedllm.kv_transfer.offload import OffloadWorker
    from pagedllm.lora.manager import LoRAManager
    from pagedllm.models.llama import LlamaForCausalLM
    from pagedllm.spec_decode.config import SpeculativeConfig
    from pagedllm.spec_decode.gate import CostGate
    from pagedllm.spec_decode.proposer import Proposer

logger = logging.getLogger("pagedllm")


@dataclass(slots=True)
class _ReqState:
    token_ids: list[int]  # prompt + every output token known so far
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    num_computed_tokens: int
    # speculative decoding
    draft_probs: torch.Tensor | None = None  # [k, V] q of the drafts proposed for the next step, if any
    spec_failures: int = 0  # steps in a row whose drafts were all rejected
    spec_pause: int = 0  # length of the current back-off, in steps
    spec_skip: int = 0  # steps left without drafting
    spec_len: int = 0  # drafts to ask for next under adaptive_length (0: num_speculative_tokens, at first)
    lora: Any = None  # the request's LoRARequest, or None
    group_block_ids: list[list[int]] = field(default_factory=list)  # the local groups' tables (kv_groups)
    pooling_params: Any = None  # a pooling request's PoolingParams
    mm_features: list[Any] = field(default_factory=list)  # its images (MultiModalFeature), by prompt position
    # M-RoPE (Qwen2-VL) for a prompt with images: its [3, prompt length] positions, and the delta of later tokens'
    mrope: tuple[torch.Tensor, int] | None = None

    @property
    def lora_int_id(self) -> int:
        return self.lora.lora_int_id if self.lora is not None else 0


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        default_seed: int = 0,
        processed_logprobs: bool = False,
        proposer: Proposer | None = None,
        spec_config: SpeculativeConfig | None = None,
        max_model_len: int | None = None,
        parallel: ParallelState | None = None,
        lora: LoRAManager | None = None,
        kv_connector: OffloadWorker | MooncakeWorker | None = None,
        pooling: PoolingConfig | None = None,
    ):
        self.model = model
        self.pooling = pooling  # set: a pooling runner (pools hidden states, samples nothing)
        self.kv_connector = kv_connector
        self.ps = parallel or ParallelState()
        self.num_tokens_computed = 0  # every token of every forward pass, for per-token figures
        self.lora = lora
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.vocab_size: int = self._lm.config.vocab_size  # (an encoder's config has one too)
        self.states: dict[str, _ReqState] = {}
        self._default_seed = default_seed
        self.processed_logprobs = processed_logprobs
        self.proposer = proposer
        self.spec_config = spec_config
        self.cost_gate: CostGate | None = None
        if proposer is not None and spec_config is not None and spec_config.backoff_by_cost:
            from pagedllm.spec_decode.gate import CostGate

            self.cost_gate = CostGate()
        self._gate_refused = False  # the cost gate kept this step's drafts out
        self.max_model_len = max_model_len or (1 << 62)
        # vision-language models: encoder outputs by image hash ([image tokens, hidden]), kept and dropped as
        # the scheduler's EncoderCacheManager says
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoder_tokens = 0  # image tokens encoded, ever

    @property
    def _lm(self) -> LlamaForCausalLM:
        """The model as a generating one: each is built as LlamaForCausalLM is (the registry only knows it as a
        class); a pooling encoder is only called."""
        return cast("LlamaForCausalLM", self.model)

    def _seed_for(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        # unseeded requests still get a private stream, stable across preemption
        digest = hashlib.sha256(f"{self._default_seed}:{req_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            if self.proposer is not None:
                self.proposer.remove(rid)
        for new in so.new_reqs:
            self.states[new.req_id] = _ReqState(
                new.prompt_token_ids + new.output_token_ids,
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.sampling_params,
                self._seed_for(new.req_id, new.sampling_params),
                new.num_computed_tokens,
                lora=new.lora_request,
                group_block_ids=[list(ids) for ids in new.group_block_ids],
                pooling_params=new.pooling_params,
                mm_features=new.mm_features,
            )
            if new.mm_features and getattr(self.model, "uses_mrope", False):
                st = self.states[new.req_id]
                st.mrope = cast(Any, self.model).mrope_positions(st.num_prompt_tokens, st.mm_features)
            if self.proposer is not None:
                self.proposer.add(new.req_id, new.num_computed_tokens)
        for c in so.cached_reqs:
            st = self.states[c.req_id]
            st.block_ids.extend(c.new_block_ids)
            for ids, new_ids in zip(st.group_block_ids, c.new_group_block_ids):
                ids.extend(new_ids)
            st.num_computed_tokens = c.num_computed_tokens

    def apply_sampled(self, sampled: dict[str, list[int]]) -> None:
        """The tokens the driver rank sampled last step, for the ranks that do not sample."""
        for rid, tokens in sampled.items():
            st = self.states.get(rid)
            if st is not None:
                st.token_ids.extend(tokens)

    def _forward(
        self, batch: Any, inputs_embeds: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> Any:
        """The model on this rank's layers: a later pipeline stage starts from the previous one's
        activations, an earlier one hands its own on. ``inputs_embeds``: the first stage's input rows, where
        a prompt's images take some of them; ``positions``: the rotary positions where they are not the
        tokens' own (M-RoPE)."""
        ps = self.ps
        extra = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}  # (a user's model may lack it)
        positions = batch.positions if positions is None else positions
        if ps.pp_size == 1:
            return self.model(batch.input_ids, positions, self.kv_caches, batch.meta, **extra)
        from pagedllm.models.llama import IntermediateTensors

        inter = None
        if not ps.is_first_stage:
            shape = (batch.input_ids.shape[0], self._lm.config.hidden_size)
            dtype = next(self._lm.layers[0].parameters()).dtype
            inter = IntermediateTensors(*ps.recv_from_prev_stage([shape, shape], dtype))
        out = self.model(batch.input_ids, positions, self.kv_caches, batch.meta, intermediate=inter, **extra)
        if not ps.is_last_stage:
            ps.send_to_next_stage([out.hidden, out.residual])
        return out

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.cost_gate is None:
            return self._execute_model(so)
        if so.new_reqs and set(self.states) <= set(so.finished_req_ids):  # new work at an idle engine
            self.cost_gate.restart()
        t0 = self.cost_gate.clock()
        self._gate_refused = False
        out = self._execute_model(so)
        spec, num = so.scheduled_spec_tokens, so.num_scheduled_tokens
        # a decode step that verified drafts (n-gram proposes only where its lookup finds a match, so a drafting
        # step need not propose again), or one that did neither; not one with a prompt chunk, nor one that only
        # proposes (the first after a pause: a draft model's catch-up), nor the one that verifies the last drafts
        # before a pause (it proposes none: a drafting step's tokens at a verification's cost alone, 0.47x the
        # time of a step that also drafts for the 1.5B; counted, it made drafting look faster than it is)
        decode = bool(out.sampled) and all(n == 1 + len(spec.get(r, ())) for r, n in num.items())
        if decode and (spec or not out.spec_token_ids) and not (spec and self._gate_refused):
            tokens = sum(len(t) for t in out.sampled.values()) / len(out.sampled)
            self.cost_gate.record(bool(spec), tokens, self.cost_gate.clock() - t0)
        elif decode and not spec and self.spec_config is not None and self.spec_config.method == "draft_model":
            self.cost_gate.record_catchup(self.cost_gate.clock() - t0)  # proposed after a pause: caught up
        return out

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.kv_connector_meta:  # saves out of blocks this step may overwrite, then loads: before all else
            assert self.kv_connector is not None, "the scheduler sends connector work only with a KV tier"
            self.kv_connector.execute(so.kv_connector_meta)
        if so.blocks_to_copy:  # copy-on-write for n>1 siblings, before anything writes this step
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=self.device)
            caches = self.kv_caches + (self.proposer.kv_caches if self.proposer is not None else [])
            for cache in {c.data_ptr(): c for c in caches}.values():  # layers of different groups share a tensor
                copy_blocks(cache, src, dst)
        if so.freed_encoder_inputs or so.scheduled_encoder_inputs:
            self._run_encoder(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        if self.pooling is not None:
            return self._execute_pooling(so, self.pooling)
        spec = so.scheduled_spec_tokens
        num = so.num_scheduled_tokens
        # one-token rows first (decodes, and every token of a request verifying drafts), then prefill chunks
        # (with LoRA, each adapter's rows side by side within each group: its LoRA term runs on whole slices)
        with_lora = self.lora is not None
        order = sorted(
            num, key=lambda r: (not (num[r] == 1 or r in spec), self.states[r].lora_int_id if with_lora else 0)
        )
        segments: list[Segment] = []
        row_starts: list[int] = []
        for rid in order:
            st = self.states[rid]
            drafts = spec.get(rid, [])
            start = st.num_computed_tokens
            row_starts.append(start)
            tokens = st.token_ids[start : start + num[rid] - len(drafts)]
            segments.append(
                Segment(
                    tokens + drafts if drafts else tokens,
                    start,
                    st.block_ids,
                    split=bool(drafts),
                    group_block_ids=st.group_block_ids,
                )
            )
        batch = build_batch(segments, self.block_size, self.device)
        step_lora: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.lora is not None:
            lora_rows = self.lora.segments(
                [(self.states[rid].lora, batch.offsets[i], batch.offsets[i + 1]) for i, rid in enumerate(order)]
            )
            if lora_rows:
                step_lora = self.lora.state.active(lora_rows)
        embeds = self._inputs_embeds(order, row_starts, so, batch.offsets, batch.input_ids)
        if getattr(self.model, "bidirectional_images", False):
            self._mark_bidirectional(order, row_starts, batch)
        with step_lora:
            hidden = self._forward(batch, embeds, self._mrope_positions(order, row_starts, batch))
        self.num_tokens_computed += so.total_num_scheduled_tokens
        for rid in order:  # the scheduler already counted these tokens (drafts too) as computed
            self.states[rid].num_computed_tokens += num[rid]
        if not self.ps.is_last_stage:
            return ModelRunnerOutput({})
        hidden, aux = hidden if isinstance(hidden, tuple) else (hidden, None)  # aux: EAGLE-3's features
        offsets = batch.offsets
        prompt_lps = self._prompt_logprobs(order, row_starts, offsets, hidden)

        # rows that sample: the last token of a request that reached its end, every row of a verification
        rows: list[tuple[_ReqState, list[int]]] = []
        logit_idx: list[int] = []
        sampled: list[str] = []
        for i, rid in enumerate(order):
            st = self.states[rid]
            drafts = spec.get(rid, [])
            if drafts:
                rows += [(st, drafts[:j]) for j in range(len(drafts) + 1)]
                logit_idx += range(offsets[i], offsets[i + 1])
            elif st.num_computed_tokens == len(st.token_ids):
                rows.append((st, []))
                logit_idx.append(offsets[i + 1] - 1)
            else:
                continue
            sampled.append(rid)
        result = ModelRunnerOutput({}, prompt_logprobs=prompt_lps)
        if sampled:
            logits = self._lm.compute_logits(hidden.index_select(0, torch.tensor(logit_idx, device=self.device)))
            if logits is None:  # a tensor-parallel rank that is not the driver: it only lent its vocab shard
                return result
            self._sample(logits, rows, sampled, spec, result, so.grammar_bitmask)
        if self.proposer is not None:
            result.spec_token_ids = self._propose(order, sampled, hidden, aux, offsets, row_starts)
        return result

    # -- images (vision-language models) ---------------------------------------------
    def _run_encoder(self, so: SchedulerOutput) -> None:
        """Drop the encoder outputs the scheduler evicted, then encode this step's images (same-sized ones in
        one batch) into the encoder cache. Only the first pipeline stage embeds, so only it encodes."""
        for identifier in so.freed_encoder_inputs:
            self.encoder_cache.pop(identifier, None)
        if not self.ps.is_first_stage:
            return
        by_shape: dict[tuple[Any, ...], list[Any]] = {}
        for rid, indices in so.scheduled_encoder_inputs.items():
            for k in indices:
                f = self.states[rid].mm_features[k]
                by_shape.setdefault((tuple(f.pixel_values.shape), f.grid_thw), []).append(f)
        model = cast(Any, self.model)
        for (_, grid), features in by_shape.items():
            pixels = torch.stack([f.pixel_values for f in features]).to(self.device)
            out = model.encode_images(pixels, grid) if grid is not None else model.encode_images(pixels)
            for f, rows in zip(features, out):
                assert rows.shape[0] == f.length, f"image encoded to {rows.shape[0]} rows for {f.length} placeholders"
                # its own copy: a view would keep the whole batch's output alive until every image of it is evicted
                self.encoder_cache[f.identifier] = rows.clone() if len(features) > 1 else rows
                self.num_encoder_tokens += f.length

    def _mark_bidirectional(self, order: list[str], row_starts: list[int], batch: Any) -> None:
        """Gemma 3: each prefill chunk's image spans in the attention metadata (``meta.bidirectional``), by the
        request's row there (a prefill row starts where its segment does; decode rows are a token each)."""
        meta = batch.meta
        rows = {meta.query_start_loc[r]: r for r in range(meta.num_decodes, len(meta.seq_lens_cpu))}
        spans: dict[int, list[tuple[int, int]]] = {}
        for i, rid in enumerate(order):
            row = rows.get(batch.offsets[i])
            start, end = row_starts[i], row_starts[i] + batch.offsets[i + 1] - batch.offsets[i]
            mine = [(f.offset, f.end) for f in self.states[rid].mm_features if f.offset < end and f.end > start]
            if row is not None and mine:
                spans[row] = mine
        if spans:
            for m in [meta, *(meta.groups or [])]:
                m.bidirectional = spans

    def _mrope_positions(self, order: list[str], row_starts: list[int], batch: Any) -> torch.Tensor | None:
        """M-RoPE positions for this step where a request with images has rows in it (None: the tokens' own):
        ``[3, T]`` where a prompt row's three differ, else the one row they share. A row in a prompt takes its
        column of the prompt's table, a later row its position plus the prompt's delta."""
        if not any(self.states[rid].mrope is not None for rid in order):
            return None
        out = batch.positions.unsqueeze(0).repeat(3, 1)
        for i, rid in enumerate(order):
            mrope = self.states[rid].mrope
            if mrope is None:
                continue
            table, delta = mrope
            a, b, start = batch.offsets[i], batch.offsets[i + 1], row_starts[i]
            in_prompt = max(0, min(b - a, table.shape[1] - start))
            out[:, a : a + in_prompt] = table[:, start : start + in_prompt].to(out.device)
            out[:, a + in_prompt : b] += delta
        return out[0] if torch.equal(out[0], out[1]) and torch.equal(out[0], out[2]) else out

    def _inputs_embeds(
        self, order: list[str], row_starts: list[int], so: SchedulerOutput, offsets: list[int], input_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """This step's input rows where a chunk holds image placeholders: the text's embeddings with each image's
        encoder rows written over its placeholders' (None where no row is an image's: the model embeds)."""
        if not self.ps.is_first_stage:
            return None
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, rid in enumerate(order):
            st = self.states[rid]
            if not st.mm_features:
                continue
            start = row_starts[i]
            end = start + so.num_scheduled_tokens[rid] - len(so.scheduled_spec_tokens.get(rid, ()))
            for f in st.mm_features:
                a, b = max(start, f.offset), min(end, f.end)
                if a < b:
                    base = offsets[i] - start
                    rows.append(torch.arange(base + a, base + b, device=self.device))
                    values.append(self.encoder_cache[f.identifier][a - f.offset : b - f.offset])
        if not rows:
            return None
        embeds = cast(Any, self.model).embed_input_ids(input_ids)
        embeds[torch.cat(rows)] = torch.cat(values).to(embeds.dtype)
        return embeds

    def _execute_pooling(self, so: SchedulerOutput, pooling: PoolingConfig) -> ModelRunnerOutput:
        """Every request's whole prompt in one pass (the scheduler never chunks one); one pooled vector each."""
        from pagedllm.engine.pooling import pool_hidden_states

        num = so.num_scheduled_tokens
        encoder = getattr(self.model, "is_pooling_model", False)
        # a decoder's one-token prompts are decode rows, which must come first in the batch
        order = list(num) if encoder else sorted(num, key=lambda r: num[r] != 1)
        states = [self.states[rid] for rid in order]
        for rid, st in zip(order, states):
            assert st.num_computed_tokens == 0 and num[rid] == len(st.token_ids), f"{rid}: pooling is one step"
        lens = [len(st.token_ids) for st in states]
        if encoder:  # bidirectional attention within each sequence, no KV cache
            dev = self.device
            ids = torch.tensor([t for st in states for t in st.token_ids], device=dev)
            positions = torch.cat([torch.arange(n, device=dev) for n in lens])
            hidden = self.model(ids, positions, lens)
        else:  # causal, through the paged cache: its K/V go to the request's blocks, freed after this step
            batch = build_batch(
                [Segment(st.token_ids, 0, st.block_ids, split=False) for st in states], self.block_size, self.device
            )
            hidden = self._forward(batch)
        self.num_tokens_computed += so.total_num_scheduled_tokens
        for rid, st in zip(order, states):
            st.num_computed_tokens = num[rid]
        if not self.ps.is_driver:  # the driver's output is the step's
            return ModelRunnerOutput({})
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        normalize = [
            pooling.normalize
            if st.pooling_params is None or st.pooling_params.normalize is None
            else st.pooling_params.normalize
            for st in states
        ]
        # plain floats: a tensor would travel between processes (the mp executor) as a shared-memory handle
        pooled = pool_hidden_states(hidden, lens, pooling.pooling, normalize).tolist()
        return ModelRunnerOutput({}, pooler_output=dict(zip(order, pooled)))

    def _sample(
        self,
        logits: torch.Tensor,
        rows: list[tuple[_ReqState, list[int]]],
        sampled: list[str],
        spec: dict[str, list[int]],
        result: ModelRunnerOutput,
        grammar: dict[str, torch.Tensor],
    ) -> None:
        sts = [self.states[rid] for rid in sampled]
        batch = self._sampling_batch(rows)
        if grammar:
            batch.grammar_bitmask = self._grammar_rows(sampled, spec, grammar)
        batch.want_probs = any(st.draft_probs is not None for st in sts)
        out = self.sampler(logits, batch)
        target = out.token_ids.tolist()
        lp = _logprob_lists(out) if out.logprobs is not None else None
        failed = set(out.failed or ())
        r = 0
        for rid, st in zip(sampled, sts):
            drafts = spec.get(rid, [])
            m = len(drafts) + 1
            if failed and not failed.isdisjoint(range(r, r + m)):
                result.failed[rid] = (
                    "no valid token could be sampled: after its penalties, bias and masks the request's "
                    "distribution had no finite logit"
                )
                st.draft_probs = None
                r += m
                continue
            if drafts:
                q = p = None
                if st.draft_probs is not None:  # then the batch wanted probs: the sampler kept them
                    assert out.probs is not None
                    q, p = st.draft_probs[: len(drafts)], out.probs[r : r + len(drafts)]
                emitted = verify(
                    drafts,
                    target[r : r + m],
                    draft_probs=q,
                    probs=p,
                    seed=st.seed,
                    position=len(st.token_ids) - st.num_prompt_tokens,
                )
                st.num_computed_tokens -= len(drafts) - (len(emitted) - 1)  # the scheduler does the same
                self._backoff(st, len(drafts), len(emitted) - 1)
            else:
                emitted = target[r : r + 1]
            st.draft_probs = None
            result.sampled[rid] = emitted
            n = st.params.logprobs
            if lp is not None and n is not None:
                entries = []
                for j, tok in enumerate(emitted):
                    row = r + j
                    if tok == target[row]:
                        entries.append(SampleLogprobs(lp[0][row][: n + 1], lp[1][row][: n + 1], lp[2][row]))
                    else:  # a token resampled from the residual: read its own logprob
                        one = SamplerOutput(torch.tensor([tok]))
                        assert out.lp_source is not None  # logprobs were asked for: the sampler kept their source
                        Sampler.gather_logprobs(out.lp_source[row : row + 1], one.token_ids, [n], one)
                        ids, vals, ranks = _logprob_lists(one)
                        entries.append(SampleLogprobs(ids[0], vals[0], ranks[0]))
                result.logprobs[rid] = entries
            st.token_ids.extend(emitted)
            r += m

    def _grammar_rows(
        self, sampled: list[str], spec: dict[str, list[int]], grammar: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The step's bitmask, row for row with the sampling batch (all ones for unconstrained rows)."""
        words = next(iter(grammar.values())).shape[1]
        parts = []
        for rid in sampled:
            m = len(spec.get(rid, [])) + 1
            parts.append(grammar[rid] if rid in grammar else torch.full((m, words), -1, dtype=torch.int32))
        return torch.cat(parts).to(self.device)

    def _draft_length(self, st: _ReqState) -> int:
        """The drafts a request asks for: num_speculative_tokens, or under adaptive_length its own length."""
        assert self.spec_config is not None, "drafts come only with a speculative config"
        k = self.spec_config.num_speculative_tokens
        return (st.spec_len or k) if self.spec_config.adaptive_length else k

    def _backoff(self, st: _ReqState, num_drafts: int, num_accepted: int) -> None:
        """A request whose drafts keep failing stops drafting for 1, 2, 4, ... (at most 64) steps; under
        adaptive_length, the length it asks for next follows this step's outcome."""
        assert self.spec_config is not None, "drafts come only with a speculative config"
        cfg = self.spec_config
        if cfg.adaptive_length:  # all accepted: 2 more next time; a rejection: 1 fewer (than asked for: the
            asked = self._draft_length(st)  # proposer and the scheduler may have cut the drafts)
            grown = asked + 2 if num_accepted == num_drafts else asked - 1
            st.spec_len = max(1, min(cfg.num_speculative_tokens, grown))
        limit = cfg.backoff_after_rejections
        if num_accepted or not limit:
            st.spec_failures = st.spec_pause = 0
            return
        st.spec_failures += 1
        if st.spec_failures >= limit:
            st.spec_pause = min(max(1, 2 * st.spec_pause), 64)
            st.spec_skip = st.spec_pause
            st.spec_failures = 0

    def _propose(
        self,
        order: list[str],
        sampled: list[str],
        hidden: torch.Tensor,
        aux: torch.Tensor | None,
        offsets: list[int],
        starts: list[int],
    ) -> dict[str, list[int]]:
        cfg, proposer = self.spec_config, self.proposer
        assert cfg is not None and proposer is not None, "a runner with a proposer has its speculative config"
        busy = cfg.disable_by_batch_size is not None and len(order) > cfg.disable_by_batch_size
        if not busy and self.cost_gate is not None and not self.cost_gate.allow():
            self._gate_refused = True
            if cfg.method not in HEADS:  # nothing to keep level: a draft model's KV catches up in one pass
                return {}  # when drafting resumes
            busy = True  # a head reads every step's hidden states: it runs, drafting nothing
        want: dict[str, int] = {}
        for rid in sampled:
            st = self.states[rid]
            if st.spec_skip:
                st.spec_skip -= 1
                continue
            room = self.max_model_len - len(st.token_ids)  # positions the drafts (and their KV) may use
            k = min(self._draft_length(st), room)
            if k > 0 and not busy:
                want[rid] = k
        ctx = ProposeContext(self.states, order, set(sampled), want, hidden, offsets, starts, aux)
        drafts = proposer.propose(ctx)
        for rid, probs in ctx.draft_probs.items():
            self.states[rid].draft_probs = probs
        return drafts

    _PROMPT_LOGITS_ROWS = 512  # bound the [rows, vocab] logits of long prompt chunks

    def _prompt_logprobs(
        self, order: list[str], row_starts: list[int], qsl: list[int], hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[SampleLogprobs]]]:
        """Raw logprobs of each prompt token given its prefix, for this step's chunk of each asking request."""
        out: dict[str, tuple[int, list[SampleLogprobs]]] = {}
        for i, rid in enumerate(order):
            st = self.states[rid]
            k = st.params.prompt_logprobs
            start = row_starts[i]
            last = min(start + qsl[i + 1] - qsl[i], st.num_prompt_tokens - 1)  # position p predicts token p+1
            if k is None or start >= last:
                continue
            entries: list[SampleLogprobs] = []
            for a in range(start, last, self._PROMPT_LOGITS_ROWS):
                b = min(a + self._PROMPT_LOGITS_ROWS, last)
                rows = torch.arange(qsl[i] + a - start, qsl[i] + b - start, device=self.device)
                logits = self._lm.compute_logits(hidden.index_select(0, rows))
                if logits is None:  # not the driver: it takes part in the gather only
                    continue
                lp = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(st.token_ids[a + 1 : b + 1], device=self.device).unsqueeze(1)
                t_lp = lp.gather(1, target)
                ranks = ((lp > t_lp).sum(dim=-1) + 1).tolist()
                top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], target[:, :0])
                ids = torch.cat([target, top_ids], dim=1).tolist()
                vals = torch.cat([t_lp, top_lp], dim=1).tolist()
                entries += [SampleLogprobs(ids[j], vals[j], ranks[j]) for j in range(b - a)]
            if entries:
                out[rid] = (start + 1, entries)
        return out

    def _sampling_batch(self, rows: list[tuple[_ReqState, list[int]]]) -> SamplingBatch:
        """One row per (request, history): a verification row's history ends with the drafts before it."""
        sts = [st for st, _ in rows]
        ps = [s.params for s in sts]
        dev = self.device
        temps = [0.0 if p.greedy else p.temperature for p in ps]
        positions = [len(st.token_ids) - st.num_prompt_tokens + len(extra) for st, extra in rows]
        stop_masks = []
        for st, n_out in zip(sts, positions):
            ids = st.params._all_stop_token_ids
            stop_masks.append(sorted(ids) if ids and n_out < st.params.min_tokens else None)
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev),
            seeds=[s.seed for s in sts],
            positions=positions,
            stop_masks=stop_masks,
            num_logprobs=[p.logprobs for p in ps],
            all_greedy=all(t == 0.0 for t in temps),
            processed_logprobs=self.processed_logprobs,
            user_processors=[
                (i, st.params, st.token_ids[: st.num_prompt_tokens], _output(st, extra))
                for i, (st, extra) in enumerate(rows)
                if st.params.logits_processors
            ]
            or None,
            no_top_k=all(p.top_k == 0 for p in ps),
            no_top_p=all(p.top_p >= 1.0 for p in ps),
            no_min_p=all(p.min_p == 0.0 for p in ps),
            penalties=self._penalties(rows) if any(p.has_penalties for p in ps) else None,
            bias=self._bias(rows)
            if any(p.logit_bias or p.allowed_token_ids is not None or p._bad_words_token_ids for p in ps)
            else None,
        )

    def _penalties(self, rows: list[tuple[_ReqState, list[int]]]) -> Penalties:
        vocab, dev = self.vocab_size, self.device
        counts = torch.zeros(len(rows), vocab, device=dev)
        prompt_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
        for i, (st, extra) in enumerate(rows):
            if st.params.has_penalties:
                out = torch.tensor(_output(st, extra), dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
                prompt_mask[i, torch.tensor(st.token_ids[: st.num_prompt_tokens], device=dev)] = True
        ps = [st.params for st, _ in rows]
        return Penalties(
            torch.tensor([p.presence_penalty for p in ps], device=dev),
            torch.tensor([p.frequency_penalty for p in ps], device=dev),
            torch.tensor([p.repetition_penalty for p in ps], device=dev),
            counts,
            prompt_mask,
        )

    def _bias(self, rows: list[tuple[_ReqState, list[int]]]) -> torch.Tensor:
        bias = torch.zeros(len(rows), self.vocab_size, device=self.device)
        for i, (st, extra) in enumerate(rows):
            p = st.params
            if p.allowed_token_ids is not None:
                bias[i] = float("-inf")
                bias[i, p.allowed_token_ids] = 0.0
            if p.logit_bias:
                bias[i, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), device=self.device)
            if p._bad_words_token_ids:
                output = _output(st, extra)
                for word in p._bad_words_token_ids:
                    prefix = word[:-1]
                    if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix):
                        bias[i, word[-1]] = float("-inf")
        return bias


def _logprob_lists(out: SamplerOutput) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Per row: the ids of the sampled token then the top-N, their logprobs, and the sampled token's rank."""
    assert out.logprob_token_ids is not None and out.logprobs is not None and out.sampled_ranks is not None
    return out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()


def _output(st: _ReqState, extra: list[int]) -> list[int]:
    """The request's output tokens, followed by ``extra`` (the drafts before a verification row)."""
    out = st.token_ids[st.num_prompt_tokens :]
    return out + extra if extra else out
