"""Turns a SchedulerOutput into one flattened batch, runs the model, samples.

Per-request state (known token ids, block ids, sampling settings) persists here
across steps and is updated from the scheduler's deltas; each step only gathers
the new tokens. The batch is ordered decodes first so the attention backend can
run all one-token queries as one batched call.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.torch_ref import copy_blocks
from pagedllm.core.scheduler import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from pagedllm.sample import Penalties, Sampler, SamplingBatch
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


@dataclass(slots=True)
class _ReqState:
    token_ids: list[int]  # prompt + every output token known so far
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    num_computed_tokens: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, default_seed: int = 0, processed_logprobs: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.vocab_size = model.config.vocab_size
        self.states: dict[str, _ReqState] = {}
        self._default_seed = default_seed
        self.processed_logprobs = processed_logprobs

    def _seed_for(self, req_id: str, params: SamplingParams) -> int:
        if params.seed is not None:
            return params.seed
        # unseeded requests still get a private stream, stable across preemption
        digest = hashlib.sha256(f"{self._default_seed}:{req_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for new in so.new_reqs:
            self.states[new.req_id] = _ReqState(
                new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids), list(new.block_ids),
                new.sampling_params, self._seed_for(new.req_id, new.sampling_params), new.num_computed_tokens)
        for c in so.cached_reqs:
            st = self.states[c.req_id]
            st.block_ids.extend(c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.blocks_to_copy:  # copy-on-write for n>1 siblings, before anything writes this step
            src = torch.tensor([s for s, _ in so.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in so.blocks_to_copy], device=self.device)
            for cache in self.kv_caches:
                copy_blocks(cache, src, dst)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        # decodes first, then prefill chunks
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        bs = self.block_size
        n_tok = so.total_num_scheduled_tokens
        input_ids = np.empty(n_tok, dtype=np.int64)
        positions = np.empty(n_tok, dtype=np.int64)
        slots = np.empty(n_tok, dtype=np.int64)
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # index into `order` of rows that produce a token
        max_blocks = max(len(self.states[r].block_ids) for r in order)
        block_table = np.zeros((len(order), max_blocks), dtype=np.int64)
        num_decodes = 0
        row_starts: list[int] = []
        for i, rid in enumerate(order):
            st = self.states[rid]
            n = so.num_scheduled_tokens[rid]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            row_starts.append(start)
            a, b = qsl[-1], qsl[-1] + n
            input_ids[a:b] = st.token_ids[start:end]
            pos = np.arange(start, end)
            positions[a:b] = pos
            bids = np.asarray(st.block_ids, dtype=np.int64)
            slots[a:b] = bids[pos // bs] * bs + pos % bs
            block_table[i, :len(bids)] = bids
            qsl.append(b)
            seq_lens.append(end)
            if n == 1:
                num_decodes += 1
            if end == len(st.token_ids):
                sample_rows.append(i)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev), block_tables=torch.from_numpy(block_table).to(dev),
            seq_lens=torch.tensor(seq_lens, device=dev), num_decodes=num_decodes, query_start_loc=qsl,
            seq_lens_cpu=seq_lens, block_size=bs)
        hidden = self.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev),
                            self.kv_caches, meta)
        for rid in order:  # the scheduler already counted these tokens as computed
            self.states[rid].num_computed_tokens += so.num_scheduled_tokens[rid]
        prompt_lps = self._prompt_logprobs(order, row_starts, qsl, hidden)
        if not sample_rows:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_lps)
        logits_idx = torch.tensor([qsl[i + 1] - 1 for i in sample_rows], device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, logits_idx))
        rids = [order[i] for i in sample_rows]
        out = self.sampler(logits, self._sampling_batch(rids))
        tokens = out.token_ids.tolist()
        result = ModelRunnerOutput(dict(zip(rids, tokens)), prompt_logprobs=prompt_lps)
        for rid, tok in zip(rids, tokens):
            self.states[rid].token_ids.append(tok)
        if out.logprobs is not None:
            lp_ids, lps, ranks = out.logprob_token_ids.tolist(), out.logprobs.tolist(), out.sampled_ranks.tolist()
            for j, rid in enumerate(rids):
                n = self.states[rid].params.logprobs
                if n is not None:
                    result.logprobs[rid] = SampleLogprobs(lp_ids[j][:n + 1], lps[j][:n + 1], ranks[j])
        return result

    _PROMPT_LOGITS_ROWS = 512  # bound the [rows, vocab] logits of long prompt chunks

    def _prompt_logprobs(self, order: list[str], row_starts: list[int], qsl: list[int],
                         hidden: torch.Tensor) -> dict[str, tuple[int, list[SampleLogprobs]]]:
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
                lp = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, rows)), dim=-1)
                target = torch.tensor(st.token_ids[a + 1:b + 1], device=self.device).unsqueeze(1)
                t_lp = lp.gather(1, target)
                ranks = ((lp > t_lp).sum(dim=-1) + 1).tolist()
                top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], target[:, :0])
                ids = torch.cat([target, top_ids], dim=1).tolist()
                vals = torch.cat([t_lp, top_lp], dim=1).tolist()
                entries += [SampleLogprobs(ids[j], vals[j], ranks[j]) for j in range(b - a)]
            out[rid] = (start + 1, entries)
        return out

    def _sampling_batch(self, rids: list[str]) -> SamplingBatch:
        sts = [self.states[r] for r in rids]
        ps = [s.params for s in sts]
        dev = self.device
        temps = [0.0 if p.greedy else p.temperature for p in ps]
        stop_masks = []
        for st in sts:
            n_out = len(st.token_ids) - st.num_prompt_tokens
            ids = st.params._all_stop_token_ids
            stop_masks.append(sorted(ids) if ids and n_out < st.params.min_tokens else None)
        return SamplingBatch(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev),
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev),
            seeds=[s.seed for s in sts],
            positions=[len(s.token_ids) - s.num_prompt_tokens for s in sts],
            stop_masks=stop_masks,
            num_logprobs=[p.logprobs for p in ps],
            all_greedy=all(t == 0.0 for t in temps),
            processed_logprobs=self.processed_logprobs,
            user_processors=[(i, st.params, st.token_ids[:st.num_prompt_tokens],
                              st.token_ids[st.num_prompt_tokens:])
                             for i, st in enumerate(sts) if st.params.logits_processors] or None,
            no_top_k=all(p.top_k == 0 for p in ps),
            no_top_p=all(p.top_p >= 1.0 for p in ps),
            no_min_p=all(p.min_p == 0.0 for p in ps),
            penalties=self._penalties(sts) if any(p.has_penalties for p in ps) else None,
            bias=self._bias(sts) if any(p.logit_bias or p.allowed_token_ids is not None
                                        or p._bad_words_token_ids for p in ps) else None,
        )

    def _penalties(self, sts: list[_ReqState]) -> Penalties:
        vocab, dev = self.vocab_size, self.device
        counts = torch.zeros(len(sts), vocab, device=dev)
        prompt_mask = torch.zeros(len(sts), vocab, dtype=torch.bool, device=dev)
        for i, st in enumerate(sts):
            if st.params.has_penalties:
                out = torch.tensor(st.token_ids[st.num_prompt_tokens:], dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
                prompt_mask[i, torch.tensor(st.token_ids[:st.num_prompt_tokens], device=dev)] = True
        ps = [st.params for st in sts]
        return Penalties(torch.tensor([p.presence_penalty for p in ps], device=dev),
                         torch.tensor([p.frequency_penalty for p in ps], device=dev),
                         torch.tensor([p.repetition_penalty for p in ps], device=dev), counts, prompt_mask)

    def _bias(self, sts: list[_ReqState]) -> torch.Tensor:
        bias = torch.zeros(len(sts), self.vocab_size, device=self.device)
        for i, st in enumerate(sts):
            p = st.params
            if p.allowed_token_ids is not None:
                bias[i] = float("-inf")
                bias[i, p.allowed_token_ids] = 0.0
            if p.logit_bias:
                bias[i, list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), device=self.device)
            output = st.token_ids[st.num_prompt_tokens:]
            for word in p._bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix):
                    bias[i, word[-1]] = float("-inf")
        return bias
