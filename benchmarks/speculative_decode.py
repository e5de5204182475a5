"""Speculative decoding (n-gram, draft model, MTP) against plain decoding: on the GPU, and
cases P and A on the CPU where torch sees no GPU (fp32 there).

  P  proposer cost: microseconds per n-gram lookup over sequences of 256 to 4096 tokens (host)
  A  batch 1, the default model (SmolLM2-135M-Instruct), greedy, prompts asking to repeat or
     edit a given text: ms per output token without and with n-gram speculation, mean
     acceptance length, speed-up, and how many outputs are identical (in bf16 a verification
     step and a decode step sum in different orders, so outputs may part at near-ties)
  B  batch 1, a random-weight model shape (``--shape``: Qwen3-0.6B, Qwen3.5-0.8B's GDN
     hybrid, DeepSeek-V2-Lite's latent attention), forced acceptance (every proposal accepted,
     whatever it is): ms per output token and per step for k = 1..7 against plain decoding,
     i.e. what verifying k tokens costs, and the host's ms per verification step by phase
     (a verification step is read at once, so its host work does not overlap the device's)
  C  the default model at batches 1 to 64 over the edit prompts: output tokens/s without and
     with speculation, to see where speculation stops paying (``disable_by_batch_size``)
  D  batch 1, the random-weight Qwen3-0.6B shape with a draft model (``method:
     "draft_model"``, k = ``--k``): a 2-layer draft of the same shape otherwise, with forced
     acceptance (what the draft's k passes and the verification cost per output token; again
     with each verification read before the next pass is scheduled, as without asynchronous
     verification, and with the proposals read on the host before the verification step is
     launched, as before they stayed on the device), the 2-layer draft's own (random)
     acceptance, and the target as its own draft (every greedy proposal accepted but at
     near-ties: mean acceptance length, and how many outputs equal plain decoding's); the
     last two also each verification read before the next pass
  E  batch 1, MTP (``method: "mtp"``) on random-weight shapes with one MTP layer
     (``--mtp-shapes``: Qwen3.5-0.8B's, DeepSeek-V3's 5-layer one), forced acceptance: as B
     for k = 1..3 (``--mtp-ks``), the head's k passes per step included (the host's
     "schedule" phase holds them), and how many of the head's steps replayed its graphs
  H  on the CPU (either way): µs of host per pass of a model proposer (MTP at k = 1..3, a
     2-layer draft at ``--k``) at batch 1, with the models stubbed and graph replays reduced
     to their host work, its decode steps chained on the device and each prepared on the host
     (``proposer_host.py``)

ms per output token is wall time of the requests' decoding (first token to last) over their
output tokens. Prints markdown tables.

    python benchmarks/speculative_decode.py [--k 4] [--max-tokens 256] [--enforce-eager]
        [--disable-by-batch-size N] [--cases PABCDEH (CPU: PAH)] [--shape qwen3-0.6b]
        [--mtp-shapes qwen3.5-0.8b deepseek-v3-5l] [--mtp-ks 1 2 3]

"verification steps replayed" counts the verification steps that replayed a graph of ``1 + k``
tokens per row (the others ran eagerly); "head steps replayed" the MTP head's steps that
replayed one of its graphs (its decode steps, and its uniform catch-ups of ``1 + k`` positions
after each verification; a request's first catch-up, over its prompt, runs eagerly).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch
import transformers as tf
from proposer_host import case_h

import heron.execution.model_runner as model_runner
from heron import LLM, SamplingParams
from heron.speculative import NgramProposer, SpecDecodeStats
from heron.speculative.verification import accepted_block

from deepseek_decode import SHAPES as DEEPSEEK_SHAPES
from gpu_decode import QWEN3_0_6B, save_config_only
from qwen3_5_decode import QWEN3_5_0_8B

# case B's shapes: (config class, its fields, architecture)
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", QWEN3_0_6B, "Qwen3ForCausalLM"),
    "qwen3.5-0.8b": ("Qwen3_5TextConfig", QWEN3_5_0_8B, "Qwen3_5ForCausalLM"),
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        DEEPSEEK_SHAPES["v2-lite"][1],
        "DeepseekV2ForCausalLM",
    ),
}
# case E's shapes, each with one MTP layer
MTP_SHAPES = {
    "qwen3.5-0.8b": (
        "Qwen3_5TextConfig",
        QWEN3_5_0_8B | {"mtp_num_hidden_layers": 1},
        "Qwen3_5ForCausalLM",
    ),
    "deepseek-v3-5l": (
        "DeepseekV3Config",
        DEEPSEEK_SHAPES["v3-5l"][1] | {"num_mtp_layers": 1},
        "DeepseekV3ForCausalLM",
    ),
}

TEXTS = [
    "The heron stood still in the shallow water of the river. It waited for a fish to swim "
    "past its long legs, and when one came close, it struck with its sharp beak. Then it "
    "flew to a tall tree on the bank and rested there until the evening.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    total = 0\n    for value in values:\n        total += (value - m) ** 2\n"
    "    return total / len(values)\n",
    "Monday: buy bread, milk and eggs. Tuesday: call the plumber about the kitchen sink. "
    "Wednesday: return the library books. Thursday: pay the electricity bill. Friday: "
    "water the plants and clean the windows.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:",
    "Rewrite the following text, changing nothing but replacing every full stop with an "
    "exclamation mark:",
]


def edit_prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.apply_chat_template([{"role": "user", "content": f"{i}\n\n{t}"}])
        for t in TEXTS
        for i in INSTRUCTIONS
    ]


def proposer_cost() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(4, 1, 4)
    print("| tokens | µs per lookup |")
    print("| --- | --- |")
    for n in (256, 1024, 4096):
        # text-like: a few hundred distinct tokens, with repeats
        # each of 50 requests' lookups as it grows by one token, after its first
        seqs = [rng.integers(0, 300, n + 1).tolist() for _ in range(50)]
        for i, seq in enumerate(seqs):
            proposer.propose(str(i), seq[:n], 4)
        start = time.perf_counter()
        for i, seq in enumerate(seqs):
            proposer.propose(str(i), seq, 4)
        print(f"| {n} | {(time.perf_counter() - start) / len(seqs) * 1e6:.1f} |")


def free_device_memory() -> None:
    """After an engine is dropped: its reference cycles hold the device memory until
    collected (the next engine's weights may need it)."""
    gc.collect()
    torch.cuda.empty_cache()


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int):
    """(ms per output token, tokens/s, outputs): ``batch`` requests at a time, each timed from
    its first token to its last."""
    engine, per_token, outputs, tokens = llm.engine, [], [], 0
    start_all = time.perf_counter()
    for first in range(0, len(prompts), batch):
        group = prompts[first : first + batch]
        times: dict[str, list[float]] = {}
        for i, prompt in enumerate(group):
            engine.add_request(str(first + i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                times.setdefault(out.request_id, []).append(time.perf_counter())
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        for request_id, ids in done.items():
            stamps = times[request_id]
            if len(ids) > 1:
                per_token.append((stamps[-1] - stamps[0]) / (len(ids) - 1))
            tokens += len(ids)
        outputs += [done[str(first + i)] for i in range(len(group))]
    wall = time.perf_counter() - start_all
    return statistics.mean(per_token) * 1e3, tokens / wall, outputs


def default_model_llm(args, speculative: dict | None, max_seqs: int) -> LLM:
    """The default model (two of them fit the GPU at once, for C)."""
    return LLM(
        gpu_memory_utilization=0.4,
        max_model_len=2048,
        max_num_seqs=max_seqs,
        cuda_graph_max_bs=max_seqs,
        enforce_eager=args.enforce_eager,
        speculative_config=speculative,
    )


def ngram_config(args) -> dict:
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    if args.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = args.disable_by_batch_size or None
    return config


def case_a(args) -> None:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = {}
    for name, spec in (("plain", None), (f"ngram k={args.k}", ngram_config(args))):
        llm = default_model_llm(args, spec, 1)
        prompts = edit_prompts(llm)
        decode(llm, prompts[:1], params, 1)  # warm-up
        llm.engine.spec_decode_stats = SpecDecodeStats()
        steps = count_steps(llm.engine.runner)
        rows[name] = (*decode(llm, prompts, params, 1), llm.spec_decode_stats, steps)
        del llm
        free_device_memory()
    base_ms, _, base_out, _, _ = rows["plain"]
    print(
        "| decoding | ms / output token | speed-up | mean acceptance length | identical "
        "| verification steps replayed |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (ms, _, outs, stats, steps) in rows.items():
        same = sum(a == b for a, b in zip(outs, base_out))
        acceptance = f"{stats.mean_acceptance_length:.2f}" if stats.num_drafts else "-"
        replayed = f"{steps[args.k + 1]}/{steps['verified']}" if stats.num_drafts else "-"
        print(
            f"| {name} | {ms:.3f} | {base_ms / ms:.2f}× | {acceptance} | {same}/{len(outs)} "
            f"| {replayed} |"
        )


class RepeatProposer:
    """Proposes the last token ``num_tokens`` times (forced acceptance makes content moot)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def propose(self, request_id: str, token_ids, limit: int) -> list[int]:
        return [token_ids[-1]] * min(limit, self.num_tokens)

    def forget(self, request_id: str) -> None:
        pass


def accept_all(proposals, targets) -> list[list[int]]:
    """Every proposal accepted, then the target's greedy token after the last (in place of the
    runner's host-side greedy acceptance, so forcing adds no device work and no sync)."""
    ends = list(accumulate(1 + len(p) for p in proposals))
    return [[*p, targets[e - 1]] for p, e in zip(proposals, ends)]


def accept_all_on_device(accepted, chosen, proposals):
    """``accept_all`` for a verification left on the device (asynchronous verification)."""
    return accepted_block(proposals.flat >= 0, chosen, proposals)


def count_steps(runner) -> Counter:
    """From now on, counts the runner's steps ("steps"), its verification steps ("verified")
    and its graph replays ("replayed", and by query length); the others run eagerly."""
    counts, launch = Counter(), runner.launch

    def counted_launch(plan, *args):
        counts.update(["steps", "verified"] if plan.verifies else ["steps"])
        return launch(plan, *args)

    runner.launch = counted_launch
    if runner.graphs is not None:
        run = runner.graphs.run
        runner.graphs.run = lambda seq: counts.update([seq.max_query_len, "replayed"]) or run(seq)
    return counts


class HostPhases:
    """From now on, the host's time in each phase of the engine's steps (wall time between
    wrappers of its calls), for a mean per verification step: where a synchronous
    verification step's time goes. "wait" runs from the replay's launch (an eager step's
    start) to the acceptance, which follows the download of the step's argmax."""

    NAMES = ("schedule", "prepare + replay", "wait for the device", "read + detokenize")

    def __init__(self, llm: LLM) -> None:
        self.seconds, self.steps, self._mark = Counter(), 0, 0.0
        engine, runner = llm.engine, llm.engine.runner
        self._time(engine.scheduler, "schedule", "schedule")
        self._time(engine, "_read", "read + detokenize")
        launch, accept = runner.launch, model_runner.accept_greedy

        def marked_launch(plan, *args):
            self.steps += plan.verifies
            self._mark = time.perf_counter()
            return launch(plan, *args)

        def marked_accept(proposals, targets):
            self._lap("wait for the device")
            return accept(proposals, targets)

        runner.launch, model_runner.accept_greedy = marked_launch, marked_accept
        if runner.graphs is not None:
            run = runner.graphs.run
            runner.graphs.run = lambda seq: (run(seq), self._lap("prepare + replay"))[0]

    def _lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] += now - self._mark
        self._mark = now

    def _time(self, owner, attribute: str, name: str) -> None:
        call = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        setattr(owner, attribute, timed)

    def row(self) -> str:
        return " | ".join(f"{self.seconds[n] / max(1, self.steps) * 1e3:.3f}" for n in self.NAMES)


def random_weight_batch_1(args, vocab_size: int) -> tuple[list[list[int]], SamplingParams, dict]:
    """Cases B and D: one random prompt, greedy to ``--max-tokens``, and the engine options of
    a dummy-weight model at batch 1."""
    prompt = [np.random.default_rng(0).integers(2, vocab_size, 128).tolist()]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(
        load_format="dummy", max_model_len=1024, max_num_seqs=1, enforce_eager=args.enforce_eager
    )
    return prompt, params, options


def case_b(args) -> None:
    forced_acceptance(args, SHAPES[args.shape], "ngram", range(1, 8))


def case_e(args) -> None:
    for name in args.mtp_shapes:
        print(f"{name}\n")
        forced_acceptance(args, MTP_SHAPES[name], "mtp", args.mtp_ks)
        print()


def forced_acceptance(args, shape: tuple, method: str, ks) -> None:
    """Cases B and E: a random-weight ``shape`` (config class, fields, architecture) at batch
    1, plainly and with every proposal accepted for each k of ``ks``; ``ngram`` proposals are
    the last token repeated (no proposer cost), ``mtp`` ones the MTP head's."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        config_class, fields, architecture = shape
        save_config_only(getattr(tf, config_class)(**fields), architecture, path)
        prompt, params, options = random_weight_batch_1(args, fields["vocab_size"])
        llm = LLM(str(path), **options)
        decode(llm, prompt, params, 1)
        plain_ms = decode(llm, prompt, params, 1)[0]
        del llm
        free_device_memory()
        head = " | head steps replayed" if method == "mtp" else ""
        print(
            "| k | ms / output token | ms / step | × plain decode step "
            f"| verification steps replayed{head} |"
        )
        print("| --- | --- | --- | --- | --- |" + " --- |" * bool(head))
        print(f"| 0 (plain) | {plain_ms:.3f} | {plain_ms:.3f} | 1.00× | -{' | -' * bool(head)} |")
        real_accept = model_runner.accept_greedy
        phases = {}
        try:
            for k in ks:
                model_runner.accept_greedy = accept_all
                spec = {"method": method, "num_speculative_tokens": k}
                llm = LLM(str(path), **options, speculative_config=spec)
                if method == "ngram":
                    llm.engine.scheduler._proposer = RepeatProposer(k)
                decode(llm, prompt, params, 1)
                steps, phases[k] = count_steps(llm.engine.runner), HostPhases(llm)
                head_steps = count_steps(llm.engine.draft_runner) if head else None
                ms = decode(llm, prompt, params, 1)[0]
                step_ms = ms * (k + 1)
                replayed = f"{steps[k + 1]}/{steps['verified']}"
                if head_steps is not None:
                    replayed += f" | {head_steps['replayed']}/{head_steps['steps']}"
                print(
                    f"| {k} | {ms:.3f} | {step_ms:.3f} | {step_ms / plain_ms:.2f}× | {replayed} |"
                )
                del llm
                free_device_memory()
        finally:
            model_runner.accept_greedy = real_accept
        print(
            f"\nHost ms per verification step, by phase\n\n| k | {' | '.join(HostPhases.NAMES)} |"
        )
        print("| --- | --- | --- | --- | --- |")
        for k, times in phases.items():
            print(f"| {k} | {times.row()} |")


def case_c(args) -> None:
    ngram = ngram_config(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print("| batch | plain tokens/s | ngram tokens/s | ratio | mean acceptance length |")
    print("| --- | --- | --- | --- | --- |")
    batches = (1, 4, 16, 64)
    results = {}
    for name, spec in (("p", None), ("s", ngram)):  # one engine at a time: each takes its share
        llm = default_model_llm(args, spec, 64)
        prompts = edit_prompts(llm)
        for batch in batches:
            work = (prompts * (-(-batch // len(prompts))))[:batch]
            # warm-up at this batch: Triton specialises kernels on integer arguments (1, and
            # multiples of 16), so a new batch's prefill may compile kernels; not while timed
            decode(llm, work, replace(params, max_tokens=8), batch)
            llm.engine.spec_decode_stats = SpecDecodeStats()
            results[name, batch] = (decode(llm, work, params, batch)[1], llm.spec_decode_stats)
        del llm
        free_device_memory()
    for batch in batches:
        (plain, _), (spec, stats) = results["p", batch], results["s", batch]
        print(
            f"| {batch} | {plain:.0f} | {spec:.0f} | {spec / plain:.2f}× | "
            f"{stats.mean_acceptance_length:.2f} |"
        )


def case_d(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target, small = Path(tmp, "target"), Path(tmp, "draft")
        save_config_only(tf.Qwen3Config(**QWEN3_0_6B), "Qwen3ForCausalLM", target)
        draft_shape = QWEN3_0_6B | {"num_hidden_layers": 2}
        save_config_only(tf.Qwen3Config(**draft_shape), "Qwen3ForCausalLM", small)
        prompt, params, options = random_weight_batch_1(args, QWEN3_0_6B["vocab_size"])
        # (name, draft, forced acceptance, proposals left on the device, async verification)
        sync = "each verification read before the next pass"
        runs = (
            ("plain", None, False, True, True),
            ("2-layer draft, forced acceptance", small, True, True, True),
            (f"2-layer draft, forced acceptance, {sync}", small, True, True, False),
            (
                "2-layer draft, forced acceptance, proposals read on the host",
                small,
                True,
                False,
                False,
            ),
            ("2-layer draft", small, False, True, True),
            (f"2-layer draft, {sync}", small, False, True, False),
            ("target as draft", target, False, True, True),
            (f"target as draft, {sync}", target, False, True, False),
        )
        print(
            f"| k = {args.k} | ms / output token | × plain | mean acceptance length "
            "| identical to plain |"
        )
        print("| --- | --- | --- | --- | --- |")
        real_accept, plain = model_runner.accept_greedy, None
        real_block = model_runner.accepted_block
        try:
            for name, draft, forced, on_device, ahead in runs:
                spec = None
                if draft is not None:
                    spec = {"method": "draft_model", "model": str(draft)}
                    spec |= {"num_speculative_tokens": args.k, "async_verification": ahead}
                model_runner.accept_greedy = accept_all if forced else real_accept
                model_runner.accepted_block = accept_all_on_device if forced else real_block
                llm = LLM(str(target), **options, speculative_config=spec)
                if draft is not None:
                    assert llm.engine.runner.async_verification == ahead, name
                scheduler = llm.engine.scheduler
                scheduler.config = replace(scheduler.config, drafts_on_device=on_device)
                decode(llm, prompt, params, 1)  # warm-up
                llm.engine.spec_decode_stats = SpecDecodeStats()
                ms, _, (tokens,) = decode(llm, prompt, params, 1)
                plain = plain or (ms, tokens)
                stats = llm.spec_decode_stats
                acceptance = f"{stats.mean_acceptance_length:.2f}" if stats.num_drafts else "-"
                same = "-" if forced or draft is None else str(tokens == plain[1])
                print(f"| {name} | {ms:.3f} | {ms / plain[0]:.2f}× | {acceptance} | {same} |")
                del llm
                free_device_memory()
        finally:
            model_runner.accept_greedy = real_accept
            model_runner.accepted_block = real_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens of A, C, D")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        help="speculation's disable_by_batch_size in A and C (default: the config's; 0: never)",
    )
    parser.add_argument("--cases", help="of PABCDEH (default: all; on the CPU P, A and H)")
    parser.add_argument("--host-steps", type=int, default=200, help="engine steps timed in H")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="of B")
    parser.add_argument(
        "--mtp-shapes", nargs="+", choices=sorted(MTP_SHAPES), default=list(MTP_SHAPES), help="of E"
    )
    parser.add_argument("--mtp-ks", type=int, nargs="+", default=[1, 2, 3], help="k of E")
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available()
    args.cases = args.cases or ("PABCDEH" if on_cuda else "PAH")
    if not on_cuda and set(args.cases) - set("PAH"):
        parser.error("cases B to E need a CUDA device (P, A and H run on the CPU)")
    print(f"device: {torch.cuda.get_device_name() if on_cuda else 'CPU'}")
    cases = {"P": proposer_cost, "A": case_a, "B": case_b, "C": case_c, "D": case_d, "E": case_e}
    cases["H"] = case_h
    for case, run in cases.items():
        if case in args.cases:
            print(f"\n### {case}\n")
            run() if case == "P" else run(args)


if __name__ == "__main__":
    main()
