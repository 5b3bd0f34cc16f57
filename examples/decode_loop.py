"""A small multi-layer decode loop in PyTorch on metrale-attn, as a serving engine runs one.

Random weights; a paged KV cache shared by every layer's page ids (vLLM's layout, `NHD`);
sequences that join with a prompt, grow one token a step (a new page when the last one is
full), finish at their own lengths and give their pages back; one batch bucket of
`--bucket` rows, the empty ones padded (seq_len 0); one split-K workspace for all layers;
the attention of every layer through `metrale_attn.serving.ModelAttention` (the custom op
`torch.ops.metrale_attn.paged_decode`), the very objects, workspace and op the vLLM backend
(`metrale_attn.integrations.vllm`) decodes with. Optionally the whole step under
`torch.compile(fullgraph=True)` (`--compile`) and, on a GPU, captured once in a CUDA graph
and replayed every step (`--cuda-graph`). Every attention output of every layer and step is
checked against the float64 reference (within 1 ulp of bf16).

    python examples/decode_loop.py                      # CPU backend, eager, a few seconds
    python examples/decode_loop.py --compile            # the step compiled (inductor)
    python examples/decode_loop.py --device cuda --compile --cuda-graph
    python examples/decode_loop.py --device cuda --compile --cuda-graph --no-check --bucket 64 \
        --min-prompt 4000 --max-len 4096 --join 1 --time 50        # time a step (median of 50)
    ... --attention sdpa                                # the same loop on PyTorch SDPA over gathered KV

`--attention sdpa` replaces our kernels by PyTorch's scaled_dot_product_attention over the
KV gathered from the pages (the baseline a user would write), held to PyTorch's own bf16
tolerance rather than our 1-ulp bar. `--time N` replays the last step N more times
(CUDA events on a GPU) and reports the median milliseconds per step.

The prompt stands in for prefill: its tokens' K and V are projected and written to the
cache, but attention over the prompt (a prefill kernel's job) is not computed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from metrale_attn import reference, tolerance
from metrale_attn.serving import ModelAttention
from metrale_attn.torch_op import to_numpy

SDPA_TOLERANCE = dict(atol=1.5e-2, rtol=1e-2)
"""What `--attention sdpa` is held to: PyTorch's own bf16 attention tolerance, not our 1 ulp."""


class PagePool:
    """Page ids of one KV cache pool, handed to sequences as they grow. Page 0 is never
    handed out: padded rows write their (ignored) K and V there, so the step keeps static
    shapes."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, 0, -1))

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache pool exhausted: raise --pages")
        return self.free.pop()

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(reversed(pages))


class Sequence:
    def __init__(self, ident: int, prompt_len: int, final_len: int):
        self.ident, self.length, self.final_len, self.pages = ident, 0, final_len, []
        self.prompt_len = prompt_len


class Model:
    """``layers`` x (fused qkv projection -> write the new token's K and V into the paged
    cache -> paged-decode attention -> output projection, residual)."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        H, KV, D = args.q_heads, args.kv_heads, args.head_dim
        self.hidden = H * D
        g = torch.Generator().manual_seed(args.seed)
        scale = self.hidden ** -0.5
        self.w_qkv = [(torch.randn(self.hidden, (H + 2 * KV) * D, generator=g) * scale).to(device, torch.bfloat16)
                      for _ in range(args.layers)]
        self.w_o = [(torch.randn(H * D, self.hidden, generator=g) * scale).to(device, torch.bfloat16)
                    for _ in range(args.layers)]
        cache_shape = (args.pages, args.page_size, KV, D)
        self.k_cache = [torch.zeros(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
        self.v_cache = [torch.zeros(cache_shape, dtype=torch.bfloat16, device=device) for _ in range(args.layers)]
        # One ModelAttention for the model: a DecodeAttention per layer over one split-K workspace.
        self.attention = ModelAttention(device, max_batch=args.bucket)
        self.attn = [self.attention.layer(H, KV, D, args.page_size, q_dtype="bfloat16", kv_dtype="bfloat16")
                     for _ in range(args.layers)]
        self.handles = [a.handle for a in self.attn]  # ints: what the compiled step holds

    def project_kv(self, layer: int, x):
        """K and V of hidden states ``x`` [n, hidden]: [n, kv_heads, head_dim] each."""
        H, KV, D = self.args.q_heads, self.args.kv_heads, self.args.head_dim
        qkv = x @ self.w_qkv[layer]
        k = qkv[:, H * D:(H + KV) * D].view(-1, KV, D)
        v = qkv[:, (H + KV) * D:].view(-1, KV, D)
        return qkv, k, v

    def step(self, x, block_tables, seq_lens, write_pages, write_slots):
        """One decode step over the bucket: ``x`` [bucket, hidden] bf16; the new token of row
        ``i`` goes to page ``write_pages[i]``, slot ``write_slots[i]`` (page 0 for padding);
        ``seq_lens`` already counts it. Returns the next hidden states and every layer's q
        and attention output (for the check)."""
        H, D = self.args.q_heads, self.args.head_dim
        n = x.shape[0]
        qs, outs = [], []
        for layer in range(self.args.layers):
            qkv, k, v = self.project_kv(layer, x)
            self.k_cache[layer][write_pages, write_slots] = k
            self.v_cache[layer][write_pages, write_slots] = v
            q = qkv[:, :H * D].view(n, H, D)  # a strided view of qkv: no copy
            if self.args.attention == "sdpa":
                out = sdpa_decode(q, self.k_cache[layer], self.v_cache[layer], block_tables, seq_lens)
            else:
                out = torch.empty((n, H, D), dtype=x.dtype, device=x.device)
                ModelAttention.decode(self.handles[layer], q, self.k_cache[layer], self.v_cache[layer], block_tables,
                                      seq_lens, out)
            x = x + out.view(n, H * D) @ self.w_o[layer]
            qs.append(q)
            outs.append(out)
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)  # keep it bounded
        return x, qs, outs


def sdpa_decode(q, k_cache, v_cache, block_tables, seq_lens):
    """The baseline: each sequence's K and V gathered from its pages (``[bucket, pages x
    page_size, kv_heads, head_dim]``), then PyTorch's scaled_dot_product_attention with the
    lengths as a mask; rows of length 0 give zeros."""
    B, P = block_tables.shape
    page, KV, D = k_cache.shape[1:]
    k = k_cache[block_tables].reshape(B, P * page, KV, D).transpose(1, 2)
    v = v_cache[block_tables].reshape(B, P * page, KV, D).transpose(1, 2)
    mask = torch.arange(P * page, device=q.device)[None, :] < seq_lens[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None],
                                                           enable_gqa=True)[:, :, 0]
    return torch.where((seq_lens > 0)[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _numpy(t):
    return to_numpy(t.detach().cpu())


def _median_step_ms(run_step, device, iters: int) -> float:
    """The median of ``iters`` timed calls of ``run_step`` (after one untimed), in ms: CUDA
    events on a GPU, the host clock on the CPU."""
    run_step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_step()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            run_step()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def run(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--bucket", type=int, default=4, help="batch rows per step (empty ones padded)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=90, help="longest a sequence grows")
    ap.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                    help="torch.compile(fullgraph=True) the step (default backend: inductor)")
    ap.add_argument("--cuda-graph", action="store_true", help="capture the step once and replay it (GPU)")
    ap.add_argument("--attention", choices=["metrale", "sdpa"], default="metrale",
                    help="metrale-attn's kernels, or PyTorch SDPA over gathered KV (the baseline)")
    ap.add_argument("--min-prompt", type=int, default=1, help="shortest prompt a joining sequence brings")
    ap.add_argument("--join", type=float, default=0.7, help="chance an empty row takes a new sequence each step")
    ap.add_argument("--no-check", action="store_true", help="skip the float64 checks (timing runs)")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="then time N replays of the last step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.min_prompt < args.max_len:
        ap.error("--min-prompt must be in 1..max-len - 1")
    if args.cuda_graph and args.device != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    device = torch.device(args.device)
    rng = np.random.default_rng(args.seed)
    prompts = torch.Generator(device=device).manual_seed(args.seed)  # drawn where they are used: 4k-token prompts
    model = Model(args, device)
    pool = PagePool(args.pages)
    B, P_S, hidden = args.bucket, args.page_size, model.hidden
    max_pages = -(-args.max_len // P_S)

    # Static inputs of the step (what a CUDA graph reads): updated in place every step.
    x = torch.zeros((B, hidden), dtype=torch.bfloat16, device=device)
    block_tables = torch.zeros((B, max_pages), dtype=torch.int32, device=device)
    seq_lens = torch.zeros(B, dtype=torch.int32, device=device)
    write_pages = torch.zeros(B, dtype=torch.int64, device=device)
    write_slots = torch.zeros(B, dtype=torch.int64, device=device)

    step = model.step
    if args.compile:
        step = torch.compile(model.step, fullgraph=True, backend=args.compile)
    graph = None

    def run_step():
        nonlocal graph
        if not args.cuda_graph:
            return step(x, block_tables, seq_lens, write_pages, write_slots)
        if graph is None:  # warm up on a side stream (compiles, if asked), then capture once
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(x, block_tables, seq_lens, write_pages, write_slots)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_step.outputs = step(x, block_tables, seq_lens, write_pages, write_slots)
        graph.replay()
        return run_step.outputs

    slots: list = [None] * B
    next_id, finished, tokens, checked = 0, 0, 0, 0
    worst_ulp, worst_abs = 0, 0.0
    t0 = time.perf_counter()
    for step_index in range(args.steps):
        # -- host bookkeeping: join, grow, pad ----------------------------------------
        for i in range(B):
            if slots[i] is None and rng.random() < args.join:
                final = int(rng.integers(args.min_prompt + 1, args.max_len + 1))
                seq = Sequence(next_id, int(rng.integers(args.min_prompt, final)), final)
                next_id += 1
                prompt = torch.randn((seq.prompt_len, hidden), generator=prompts, device=device).to(torch.bfloat16)
                seq.pages = [pool.take() for _ in range(-(-seq.prompt_len // P_S))]
                pos = torch.arange(seq.prompt_len, device=device)
                pages = torch.tensor(seq.pages, device=device)[pos // P_S]
                for layer in range(args.layers):  # prefill stand-in: the prompt's K and V only
                    _, k, v = model.project_kv(layer, prompt)
                    model.k_cache[layer][pages, pos % P_S] = k
                    model.v_cache[layer][pages, pos % P_S] = v
                seq.length = seq.prompt_len
                x[i] = prompt[-1]
                slots[i] = seq
        bt, lens = np.zeros((B, max_pages), np.int32), np.zeros(B, np.int32)
        wp, ws = np.zeros(B, np.int64), np.zeros(B, np.int64)
        for i, seq in enumerate(slots):
            if seq is None:
                continue  # padding: seq_len 0, writes to page 0
            if seq.length % P_S == 0:
                seq.pages.append(pool.take())
            wp[i], ws[i] = seq.pages[seq.length // P_S], seq.length % P_S
            seq.length += 1
            lens[i] = seq.length
            bt[i, :len(seq.pages)] = seq.pages
        block_tables.copy_(torch.from_numpy(bt))
        seq_lens.copy_(torch.from_numpy(lens))
        write_pages.copy_(torch.from_numpy(wp))
        write_slots.copy_(torch.from_numpy(ws))

        # -- the step ----------------------------------------------------------------
        new_x, qs, outs = run_step()

        # -- check every layer's attention against the float64 reference ---------------
        for layer in range(0 if args.no_check else args.layers):
            q, out = _numpy(qs[layer]), _numpy(outs[layer])
            k, v = _numpy(model.k_cache[layer]), _numpy(model.v_cache[layer])
            ref = reference.paged_decode(q, k, v, bt, lens)
            if args.attention == "sdpa":
                torch.testing.assert_close(torch.from_numpy(out.astype(np.float64)), torch.from_numpy(ref),
                                           **SDPA_TOLERANCE)
            else:
                tolerance.assert_close_to_reference(out, ref, v_absmax=reference.max_abs_v_read(v, bt, lens),
                                                    what=f"layer {layer} attention")
                worst_ulp = max(worst_ulp, int(tolerance.ulp_distance(out, tolerance.round_to(ref, out.dtype)).max()))
            worst_abs = max(worst_abs, float(np.abs(out.astype(np.float64) - ref).max(initial=0.0)))
            assert not out[lens == 0].astype(np.float32).any(), "padded rows must be zeros"
            checked += 1
        x.copy_(new_x)
        tokens += int((lens > 0).sum())

        # -- finish (not on the last step of a timed run: its inputs are what is timed) --------
        for i, seq in enumerate(slots if not (args.time and step_index == args.steps - 1) else ()):
            if seq is not None and seq.length >= seq.final_len:
                pool.give_back(seq.pages)
                slots[i] = None
                finished += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    in_use = args.pages - 1 - len(pool.free)
    summary = dict(steps=args.steps, layers=args.layers, tokens=tokens, sequences=next_id, finished=finished,
                   pages_in_use=in_use, attention_calls_checked=checked, worst_ulp=worst_ulp, worst_abs_err=worst_abs,
                   seconds=elapsed,
                   attention=args.attention, bucket=B, context=int(lens.max()) if lens.size else 0)
    mode = " ".join(m for m in (args.attention, f"compile={args.compile}" if args.compile else "eager",
                                "cuda-graph" if args.cuda_graph else "") if m)
    print(f"decode loop on {args.device} ({mode}): {args.steps} steps x {args.layers} layers, bucket {B}; "
          f"{tokens} tokens decoded for {next_id} sequences ({finished} finished, {in_use} pages in use); "
          f"{checked} attention outputs checked, worst {worst_ulp} ulp (bf16), {worst_abs:.2e} abs; {elapsed:.1f} s")
    if args.time:
        summary["step_ms"] = _median_step_ms(run_step, device, args.time)
        summary["timed_lens"] = [int(n) for n in lens]
        print(f"step time ({mode}, bucket {B}, {int((lens > 0).sum())} sequences of up to {summary['context']} "
              f"tokens): {summary['step_ms']:.3f} ms (median of {args.time})")
    return summary


if __name__ == "__main__":
    run()
