"""`weightstream bench --kind codec`: the wire codec alone, on one group of Hugging Face-initialized
weights (normal, std 0.02) per dtype (formerly `benchmarks/bench_decoder.py`).

For bf16 and fp16, one group of `--group-size` bytes is encoded (`wire.codec.encode_group`), then
decoded `--reps` times after warm-up by:
- `torch-decoder`: the pure-torch reference decoder (`codec.decode_group`), on any device;
- `triton-decoder-wN`: the GPU decoder (`wire.triton_decoder`) at N warps per program, for each N of
  `--warps` (CUDA only: skipped rows on a CPU; the committed kernel uses `triton_decoder._WARPS`);
- `triton-decoder-in-place-wN`: the same decoder reading the blob in place from pinned host memory
  through a zero-copy view (`engine.uva.uva_view`), so the compressed bytes cross the link inside the
  kernel: what decoding routed experts straight from host memory would cost. Its setup's `wire_GBps`
  (wire bytes read per second, in every Triton row) compares with the document's measured host->GPU
  bandwidth.

Each row: median ms per decode, `exact` = the decoded bytes `torch.equal` to the original weights' bytes
(lossless), the wire fields (`wire_bytes`, `wire_raw_bytes`, `wire_ratio` of the group), `tokens` = the
values decoded (so tokens/s is values per second) and `setup` with the decoded GB/s and the chunk
count. The model-level comparison of raw against compressed streaming (formerly `bench_codec.py`) is
the suite's `--methods ws-stream-raw,ws-stream-compress` (or the `ws-auto-*` variants).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import torch

from ..sizes import format_size
from ..wire import codec
from .measure import fill_row, h2d_bandwidth, measure
from .progress import first_line, log
from .runner import base_header
from .schema import ResultRow, write_json

DTYPES = ("bfloat16", "float16")


def size_label(nbytes: int) -> str:
    """A size without spaces for names: 256MiB, 1KiB, or bytes."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"
SHORT = {"bfloat16": "bf16", "float16": "fp16"}


@contextlib.contextmanager
def warps(n: int):
    """The GPU decoder launched with `n` warps per program inside the block."""
    from ..wire import triton_decoder

    saved = triton_decoder._WARPS
    triton_decoder._WARPS = n
    try:
        yield
    finally:
        triton_decoder._WARPS = saved


def encoded_group(dtype: torch.dtype, nbytes: int, device: torch.device, seed: int):
    """(the weights' bytes, the encoded group, its blob on `device`) of `nbytes` of HF-initialized
    weights in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(nbytes // 2, generator=gen) * 0.02).to(dtype).to(device)
    enc = codec.encode_group([(weights, 0)], nbytes, device=device)
    if enc is None:
        raise ValueError(f"a {format_size(nbytes)} {dtype} group does not shrink: nothing to decode")
    return weights.view(torch.uint8), enc, enc.blob.to(device)


def decoder_row(method: str, phase: str, call, want: torch.Tensor, out: torch.Tensor, enc, reps: int,
                device: torch.device) -> ResultRow:
    """Time one decoder into a row; exact = the decoded bytes equal the weights' bytes."""
    nbytes = want.numel()
    row = ResultRow(method, phase, None, "eager", tokens=nbytes // 2, wire_bytes=enc.wire_bytes,
                    wire_raw_bytes=nbytes, wire_ratio=enc.wire_bytes / nbytes,
                    reference="the weights' own bytes (lossless)", setup={"chunks": enc.chunks})
    try:
        out.zero_()
        entry, _ = measure(call, reps, device)
        fill_row(row, entry, None)
        row.exact = torch.equal(out, want)
        row.setup["decoded_GBps"] = nbytes / (row.median_ms / 1e3) / 1e9
    except Exception as exc:  # record and go on: the other decoders still count
        row = ResultRow(method, phase, None, "eager", tokens=nbytes // 2, error=first_line(exc),
                        wire_bytes=enc.wire_bytes, wire_raw_bytes=nbytes, wire_ratio=enc.wire_bytes / nbytes)
    return row


def run_codec(group_bytes: int, warp_counts: list[int], reps: int, device: torch.device, out_path: str, *,
              seed: int = 0, command: str = "") -> dict:
    """The `--kind codec` run (module docstring); writes and returns the result document."""
    bandwidth = h2d_bandwidth(device) if device.type == "cuda" else None
    shape = {"name": f"codec-group-{size_label(group_bytes)}", "group_bytes": group_bytes,
             "init": "normal(0, 0.02)", "dtype": ",".join(DTYPES), "chunk_values": codec.CHUNK}
    doc = base_header(device, bandwidth, command, "codec", shape, group_bytes, str(device))
    phases = [f"{SHORT[d]}-{size_label(group_bytes)}" for d in DTYPES]
    doc.update(budgets=[], phases=phases, reference="the weights' own bytes", build_note="one group")
    for dtype_name, phase in zip(DTYPES, phases, strict=True):
        for row in dtype_rows(dtype_name, phase, group_bytes, warp_counts, reps, device, seed):
            doc["results"].append(asdict(row))
            speed = f"{row.setup['decoded_GBps']:.1f} GB/s" if "decoded_GBps" in row.setup else ""
            if "wire_GBps" in row.setup:
                speed += f" decoded ({row.setup['wire_GBps']:.1f} GB/s of wire bytes read)"
            log(f"{row.method} {phase}: " + (f"{row.median_ms:.3f} ms, {speed}, exact {row.exact}"
                                             if row.median_ms is not None else row.error or row.skipped))
        write_json(doc, out_path)
    return doc


def dtype_rows(dtype_name: str, phase: str, group_bytes: int, warp_counts: list[int], reps: int,
               device: torch.device, seed: int) -> list[ResultRow]:
    """The rows of one dtype's group: the torch decoder's, then the GPU decoder's at each warp count."""
    want, enc, blob = encoded_group(getattr(torch, dtype_name), group_bytes, device, seed)
    log(f"{dtype_name}: {format_size(group_bytes)} -> {format_size(enc.wire_bytes)} on the wire (ratio "
        f"{enc.wire_bytes / group_bytes:.4f}), {enc.chunks} chunks")
    out = torch.zeros(group_bytes, dtype=torch.uint8, device=device)
    rows = [decoder_row("torch-decoder", phase, lambda: codec.decode_group(blob, out), want, out, enc, reps,
                        device)]
    rows += triton_rows("triton-decoder", phase, lambda: blob, want, out, enc, warp_counts, reps, device,
                        skip="the Triton decoder needs a CUDA device")
    rows += triton_rows("triton-decoder-in-place", phase, lambda: in_place(blob, device), want, out, enc,
                        warp_counts, reps, device, skip="reading host memory in place needs a CUDA device")
    return rows


def in_place(blob: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A zero-copy device view of a pinned host copy of `blob`: the decoder reads it across the link."""
    from ..engine.uva import uva_view

    host = torch.empty(blob.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(blob)
    return uva_view(host, device)


def triton_rows(method: str, phase: str, source, want: torch.Tensor, out: torch.Tensor, enc,
                warp_counts: list[int], reps: int, device: torch.device, *, skip: str) -> list[ResultRow]:
    """The GPU decoder at each warp count (`<method>-wN`), reading the blob `source()` makes (skipped
    rows saying `skip` on a CPU); each row's setup has `warps` and `wire_GBps`, the wire bytes it read
    per second."""
    methods = [f"{method}-w{n}" for n in warp_counts]
    if device.type != "cuda":
        return [ResultRow(m, phase, None, "eager", skipped=skip) for m in methods]
    from ..wire import triton_decoder

    blob = source()
    rows = []
    for n, name in zip(warp_counts, methods, strict=True):
        def call(n=n):
            with warps(n):
                triton_decoder.decode(blob, out, enc.chunks)
        row = decoder_row(name, phase, call, want, out, enc, reps, device)
        row.setup["warps"] = n
        if row.median_ms is not None:
            row.setup["wire_GBps"] = enc.wire_bytes / (row.median_ms / 1e3) / 1e9
        rows.append(row)
    return rows
