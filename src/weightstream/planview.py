"""`weightstream plan`: show where a model's weights would go under a budget, and the predicted time."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import OffloadConfig, config_of, refuse_unsplit_options
from .errors import ArgumentError
from .formats.hf import choose_disk_groups, diffusers_class
from .pipeline import AUTO_RAW_NOTE
from .placement.plan import predict_placement, wire_of
from .placement.prepare import prepare
from .placement.probe import load_profile
from .placement.shapes import meta_model
from .sizes import format_size, parse_size


def _stored_diffusers_dtype(model_name: str) -> torch.dtype | None:
    """The dtype a diffusers model folder's weights are stored in (as a pipeline folder's components are
    planned), or None for anything else (a built-in shape, a transformers checkpoint: their defaults)."""
    folder = Path(model_name)
    if not (folder / "config.json").is_file() or diffusers_class(folder) is None:
        return None
    from .pipeline import stored_dtype

    return stored_dtype(model_name)


def plan_report(model_name: str, gpu_memory: int | str | OffloadConfig, tokens: int | None = None,
                strategy: str = "auto",
                prefill_tokens: int = 2048, dtype: str | torch.dtype | None = None,
                cpu_memory: int | str | None = None, compress: bool | str = "auto",
                speculate: str | None = None) -> dict:
    """The placement of `model_name` (built-in shape, local checkpoint folder or diffusers model folder)
    under `gpu_memory`, optimized for `tokens` tokens per forward (None: 1 for a causal LM; for a
    diffusers model what it sees at its pipeline's default generation, `pipeline.denoiser_tokens`:
    4608 for Flux at 1024x1024, 4096 where no default is known), with predicted ms
    for decode (1 token) and prefill, or for a diffusers model one forward at `tokens`; plain data.

    dtype: the dtype to plan in (default: a local checkpoint's own, as `from_pretrained` loads it; for a
    diffusers model folder the dtype its weights are stored in; bfloat16 for a built-in shape).
    cpu_memory: host memory for the offloaded weights, as for `from_pretrained` (default: no limit).
    With the same arguments `from_pretrained` gets the same placement. compress: as for `offload` (wire
    sizes predicted from Hugging Face-initialized weights' ratio; "auto" is raw on a machine without
    CUDA, whatever GPU the profile is, and the report's `wire.auto_raw_without_cuda` says so).
    `gpu_memory` may be an `OffloadConfig` holding strategy, compress (whose "auto" is resolved: the
    report cannot say it), tokens (used where `tokens` is None), profile, the expert options and the
    device whose profile plans when it holds none.

    speculate: a draft for speculative decoding, counted in the same budget (`speculative.budget`):
    "self" (int4 copies, groups of 128, of the blocks kept off the GPU), "prompt-lookup" (no bytes) or
    the folder of a draft checkpoint (its weights in `dtype`); the placement is the target's share and
    the result's "speculative" entry the split: target resident, staging and draft bytes. The split
    plans without expert copies and with a GPU expert cache where faster: a config asking otherwise
    raises ArgumentError (`config.refuse_unsplit_options`)."""
    config = config_of(gpu_memory, strategy=strategy, compress=compress)
    # "auto" is raw on a machine without CUDA (OffloadConfig), whatever GPU the profile describes
    auto_raw = compress == "auto" and not isinstance(gpu_memory, OffloadConfig) and not config.compress
    if speculate is not None:
        refuse_unsplit_options(config, speculate)
    if tokens is not None and config.tokens not in (1, tokens):
        raise ArgumentError(f"tokens={tokens} given beside an OffloadConfig with tokens={config.tokens}: set "
                            "them in the config (config.replace(tokens=...)), or give one of them")
    model = meta_model(model_name, dtype if dtype is not None else _stored_diffusers_dtype(model_name))
    diffusers_model = type(model).__module__.startswith("diffusers")
    if tokens is None and config.tokens != 1:  # a config's tokens, as offload takes them
        tokens = config.tokens
    if tokens is None:
        from .pipeline import denoiser_tokens

        tokens = denoiser_tokens(model) if diffusers_model else 1
    profile = load_profile(config.device) if config.profile is None else config.profile
    host_bytes = None if cpu_memory is None else parse_size(cpu_memory)
    prep = prepare(model, config.replace(tokens=tokens, profile=profile), allow_meta=True,
                   host_bytes=host_bytes)
    p, cost = prep.placement, prep.cost
    split = None
    if speculate is not None:
        from .speculative.budget import split_placement
        from .speculative.draft import resolve_draft
        from .speculative.shape_costs import planned_choice

        draft = (speculate if speculate in ("self", "prompt-lookup")
                 else meta_model(speculate, next(model.parameters()).dtype))
        split = split_placement(model, cost, config.gpu_memory, draft, tokens=tokens, profile=profile,
                                strategy=config.strategy, compress=config.compress, host_bytes=host_bytes,
                                blocks=config.blocks)
        p = split.placement
        choice = planned_choice(cost, p, profile, resolve_draft(draft))
    # a causal LM: decode and prefill; any other model (a diffusers denoiser): the tokens planned for
    phases = ((("decode", 1), (f"prefill_{prefill_tokens}", prefill_tokens)) if not diffusers_model
              else ((f"forward_{tokens}", tokens),))
    predictions = {
        name: predict_placement(cost, p, n, profile)
        for name, n in phases
    }
    host_limit = None if host_bytes is None else host_bytes - sum(prep.uva_group_bytes)
    on_disk = choose_disk_groups(prep.group_bytes, host_limit)  # what from_pretrained leaves in the files
    resident_blocks = [i for i in range(len(cost.block_bytes)) if i not in p.streamed and i not in p.uva]
    return {
        "model": model_name,
        "budget_bytes": config.gpu_memory,
        "optimized_for_tokens": tokens,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "profile": {"gpu": profile.gpu, "h2d_GBps": round(profile.h2d_GBps, 1)},
        "weight_bytes": cost.fixed_bytes + sum(cost.block_bytes),
        "requested_strategy": p.requested_strategy,
        "placement_kind": p.kind,
        "blocks": len(cost.block_bytes),
        "resident": {"bytes": p.resident_bytes, "blocks": resident_blocks},
        "streamed": {"bytes": sum(cost.streamed_bytes(i, p.part) for i in p.streamed),
                     "blocks": list(p.streamed), "slots": p.n_slots, "slot_bytes": p.slot_bytes,
                     "largest_tensors_per_block": p.part or None},
        # experts_only_blocks: zero-copy blocks read in place for their routed experts only (the rest
        # of each resident)
        "zero_copy": {"bytes": p.uva_bytes, "blocks": list(p.uva),
                      "experts_only_blocks": list(p.uva_experts)},
        # a GPU expert cache: blocks (of experts_only_blocks) whose routed experts go through a static
        # pool of `slots` experts each; bytes: the pools plus their work buffers (in gpu_bytes)
        # expert copies: blocks (of experts_only_blocks) whose routed experts the copy engine copies
        # into work buffers every forward once the host has read the routing; bytes: the work buffers
        # coded: held compressed, one blob per expert, decoded on the GPU through two landing buffers
        # of landing_bytes (in gpu_bytes); wire_ratio: the routed experts' predicted compressed share
        "expert_copies": {"blocks": list(p.expert_copies),
                          "bytes": cost.cache_bytes(p.expert_copies, 0),
                          "coded": bool(p.copy_landing_bytes), "landing_bytes": p.copy_landing_bytes,
                          "wire_ratio": (round(sum(cost.routed_wire_ratio(i) for i in p.expert_copies)
                                               / len(p.expert_copies), 3) if p.copy_landing_bytes else 1.0)},
        "expert_cache": {"blocks": list(p.expert_cache), "slots": p.expert_slots,
                         "bytes": p.cache_bytes - cost.cache_bytes(p.expert_copies, 0),
                         "experts": cost.experts, "hit_share": cost.cache_hit(p.expert_slots),
                         # the Zipf exponent of expert popularity planned for (None: uniform routing)
                         "routing_skew": config.routing_skew},
        "disk": {"bytes": sum(cost.streamed_bytes(p.streamed[g], p.part) for g in on_disk),
                 "blocks": [p.streamed[g] for g in sorted(on_disk)],
                 # what a forward reads from disk: compressed groups' blobs (predicted) from the cache
                 "wire_bytes": sum(cost.wire_bytes(p.streamed[g], p.part) if p.compressed
                                   else cost.streamed_bytes(p.streamed[g], p.part) for g in on_disk)},
        "wire": {**_wire(cost, p), "auto_raw_without_cuda": auto_raw},
        "gpu_bytes": p.gpu_bytes,
        # ms: a forward in a loop of them (its first groups copied during the forward before);
        # first_ms: the first forward, or a CUDA graph replay (which starts with nothing staged)
        "predicted": {k: {"ms": round(v.again_ms, 2), "first_ms": round(v.ms, 2), "bound": v.bound,
                          "compute_ms": round(v.compute_ms, 2), "link_ms": round(v.link_ms, 2),
                          "link_bytes": round(v.link_bytes)}
                      for k, v in predictions.items()},
        # speculative decoding: the budget split between the target's weights and the draft's
        "speculative": ({**split.as_dict(), "predicted": _speculation(choice, predictions.get("decode"))}
                        if split is not None else None),
    }


def _speculation(choice, decode) -> dict | None:
    """What the automatic tree shape predicts at the draft's prior acceptance (`planned_choice`), beside
    plain decoding's forward in a loop; None where it is not predicted (a draft model)."""
    if choice is None or decode is None:
        return None
    plain = 1e3 / decode.again_ms
    return {"width": choice.width, "depth": choice.depth, "tokens": choice.tokens,
            "prior_acceptance": choice.acceptance, "expected_accepted": round(choice.expected_accepted, 2),
            "verify_ms": round(choice.verify_ms, 4), "draft_ms": round(choice.draft_ms, 4),
            "tokens_per_s": round(choice.tokens_per_second, 3), "plain_tokens_per_s": round(plain, 3),
            "speedup": round(choice.tokens_per_second / plain, 2)}


def _wire(cost, p) -> dict:
    """The streamed groups on the link: compressed or raw, predicted wire bytes against their raw
    bytes, the ratio, and the landing buffers (how many, and the bytes of each; 0 when groups stream
    raw)."""
    wire, raw = wire_of(cost, p)
    return {"compressed": p.compressed, "bytes": wire, "raw_bytes": raw,
            "ratio": round(wire / raw, 4) if raw else 1.0, "landing_bytes": p.landing_bytes,
            "landing_buffers": p.n_landing}


def format_report(r: dict) -> str:
    """A readable table of `plan_report`'s result."""
    def size(n):
        return format_size(n)

    lines = [
        f"{r['model']}: {size(r['weight_bytes'])} of {r['dtype']} weights in {r['blocks']} blocks; budget "
        f"{size(r['budget_bytes'])}; planned for {r['optimized_for_tokens']} token(s) per forward on "
        f"{r['profile']['gpu']} ({r['profile']['h2d_GBps']} GB/s host->GPU)",
        f"{'':12}{'blocks':>8}{'bytes':>14}",
        f"{'resident':12}{len(r['resident']['blocks']):>8}{size(r['resident']['bytes']):>14}"
        "   (with everything outside the blocks)",
        f"{'streamed':12}{len(r['streamed']['blocks']):>8}{size(r['streamed']['bytes']):>14}"
        f"   through {r['streamed']['slots']} slot(s) of {size(r['streamed']['slot_bytes'])}"
        + (f"; only each block's {r['streamed']['largest_tensors_per_block']} largest tensors, the rest "
           "of it resident" if r["streamed"]["largest_tensors_per_block"] else ""),
        f"{'zero copy':12}{len(r['zero_copy']['blocks']):>8}{size(r['zero_copy']['bytes']):>14}"
        + (f"   {len(r['zero_copy']['experts_only_blocks'])} of them only their routed experts, the rest "
           "of each resident" if r["zero_copy"].get("experts_only_blocks") else ""),
        *([f"{'expert cache':12}{len(r['expert_cache']['blocks']):>8}{size(r['expert_cache']['bytes']):>14}"
           f"   {r['expert_cache']['slots']} of {r['expert_cache']['experts']} experts per block on the GPU "
           "(the most frequently routed), pools and work buffers; "
           f"{r['expert_cache']['hit_share']:.0%} of the routed reads under "
           + ("uniform routing" if r["expert_cache"].get("routing_skew") is None
              else f"Zipf({r['expert_cache']['routing_skew']:g}) routing")
           + "; its launches are predicted as replayed from a CUDA graph (eagerly they cost more than the "
             "cache saves at decode)"]
          if r.get("expert_cache", {}).get("blocks") else []),
        *([f"{'expert copies':13}{len(r['expert_copies']['blocks']):>7}"
           f"{size(r['expert_copies']['bytes']):>14}   work buffers; each forward the host reads the "
           "routing and the copy engine copies the routed experts in (eager and compiled, no CUDA graphs)"
           + (f"; held compressed (ratio {r['expert_copies']['wire_ratio']:.3f}), decoded on the GPU through "
              f"2 landing buffers x {size(r['expert_copies']['landing_bytes'])}"
              if r['expert_copies'].get("coded") else "")]
          if r.get("expert_copies", {}).get("blocks") else []),
        f"on the wire: {size(r['wire']['bytes'])} of {size(r['wire']['raw_bytes'])} streamed per forward, "
        + (f"compressed (ratio {r['wire']['ratio']:.3f}; landing buffers {r['wire']['landing_buffers']} x "
           f"{size(r['wire']['landing_bytes'])}, counted in the GPU memory)"
           if r["wire"]["compressed"] else "raw (ratio 1.000; no landing buffers)")
        + (f"; {AUTO_RAW_NOTE}" if r["wire"].get("auto_raw_without_cuda") and r["wire"]["raw_bytes"] else ""),
        *([f"{'on disk':12}{len(r['disk']['blocks']):>8}{size(r['disk']['bytes']):>14}"
           + (f"   (streamed; {size(r['disk']['wire_bytes'])} read each forward from a compressed cache "
              "file)" if r["wire"]["compressed"] else
              "   (streamed, read from the checkpoint files each forward)")] if r["disk"]["blocks"] else []),
        f"GPU memory for weights: {size(r['gpu_bytes'])} (placement: {r['placement_kind']}, asked for "
        f"{r['requested_strategy']})",
    ]
    spec = r.get("speculative")
    if spec is not None:
        lines.append(
            f"budget split with the {spec['draft']} draft: target resident "
            f"{size(spec['target_resident_bytes'])} + staging {size(spec['staging_bytes'])} + draft "
            f"{size(spec['draft_bytes'])}"
            + (f" (low-bit copies of {spec['drafted_blocks']} blocks)" if spec["drafted_blocks"] else "")
            + f" = {size(spec['total_bytes'])} of {size(spec['gpu_memory'])} (the target planned with "
            f"{size(spec['weights_budget'])}; KV caches not counted)")
        guess = spec.get("predicted")
        if guess is not None:
            lines.append(
                f"predicted speculative decode (modelled: the {spec['draft']} draft's prior acceptance "
                f"{guess['prior_acceptance']}, not measured on this model): tree {guess['width']}x"
                f"{guess['depth']}, {guess['expected_accepted']} drafted tokens accepted a pass, verify "
                f"{guess['verify_ms']:.1f} ms + draft {guess['draft_ms']:.1f} ms: "
                f"{guess['tokens_per_s']:.2f} tokens/s against {guess['plain_tokens_per_s']:.2f} plain "
                f"({guess['speedup']}x)")
    for phase, p in r["predicted"].items():
        lines.append(f"predicted {phase}: {p['ms']:.1f} ms per forward in a loop ({p['first_ms']:.1f} ms "
                     f"the first), {p['bound']}-bound (compute {p['compute_ms']:.1f} ms, link "
                     f"{p['link_ms']:.1f} ms, {size(round(p['link_bytes']))} over the link)")
    if r["disk"]["blocks"]:  # the cost model has no disk rate: say what it leaves out
        lines.append(f"the predictions leave out reading {size(r['disk']['wire_bytes'])} from disk "
                     "every forward (about 2 GB/s from a cold page cache, 6 GB/s from a warm one on "
                     "the H200 machine)")
    return "\n".join(lines)
