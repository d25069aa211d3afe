"""Offload a whole Flux.1-dev pipeline (CLIP + T5-XXL text encoders, the 12B transformer, the VAE) under one
GPU budget with weightstream, generate one image and print the milliseconds of each denoising step.

The pipeline is built from the published configs (`weightstream.bench.flux_pipeline`) with RANDOM
weights (nothing is downloaded) and in-memory word-level tokenizers, so the image is noise: the point
is the memory and the step time.
With real weights, replace `build_pipeline` by `FluxPipeline.from_pretrained(...,
torch_dtype=torch.bfloat16)`; the two lines that matter stay the same:

    handle = ws.offload(pipe, gpu_memory="12GiB")   # one budget across every model of the pipeline
    image = pipe(prompt, ...).images[0]

    python examples/flux_offload.py                      # full size, needs CUDA and ~40 GB of host RAM
    python examples/flux_offload.py --compress false     # the same, every component streaming raw
    python examples/flux_offload.py --tiny --device cpu  # a tiny config: runs anywhere in seconds
    python examples/flux_offload.py --tiny --check       # also checks the image against the resident pipeline
"""

from __future__ import annotations

import argparse
import time

import torch

import weightstream as ws
from weightstream.bench.flux_pipeline import build_pipeline, configs  # FLUX.1-dev from its configs
from weightstream.engine.host import available_host_bytes
from weightstream.pipeline import offload_pipeline


def generate(pipe, args, device: torch.device) -> tuple[torch.Tensor, list[float]]:
    """One image (a float tensor, (1, 3, H, W)) and the wall-clock ms of each denoising step."""
    marks = [time.perf_counter()]

    def on_step_end(pipe, step, timestep, kwargs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
        return kwargs

    out = pipe(args.prompt, height=args.size, width=args.size, num_inference_steps=args.steps,
               guidance_scale=3.5, max_sequence_length=configs(args.tiny)["t5_tokens"], output_type="pt",
               generator=torch.Generator().manual_seed(args.seed), callback_on_step_end=on_step_end)
    return out.images, [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]


def need_what_it_takes(tiny: bool, device: torch.device) -> bool:
    """Check, before building anything, what this run needs: a CUDA GPU for the full-size pipeline,
    and host memory for its weights (built on the CPU first); say what is missing and the way out."""
    if not tiny and device.type != "cuda":
        print("the full-size FLUX.1-dev pipeline needs a CUDA GPU (one step on a CPU takes hours): run "
              "with --tiny --device cpu to see it work anywhere")
        return False
    meta = build_pipeline(tiny, device="meta")  # sizes only: nothing allocated
    need = sum(t.numel() * t.element_size() for m in meta.components.values()
               if isinstance(m, torch.nn.Module) for t in m.state_dict().values())
    available = available_host_bytes()
    if available is not None and need > available:
        print(f"the pipeline's weights need {ws.format_size(need)} of host memory to build, but "
              f"{ws.format_size(available)} is available: free memory, or run with --tiny")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU-sized) instead of FLUX.1-dev's")
    p.add_argument("--gpu-memory", default=None,
                   help='budget for all the weights on the GPU, e.g. "12GiB" (default; --tiny: half the '
                        'bytes)')
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; --tiny: 2)")
    p.add_argument("--size", type=int, default=None, help="image height and width (default 1024; --tiny: 16)")
    p.add_argument("--prompt", default="a photo of an astronaut riding a horse on the moon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="first generate with every weight resident; check the offloaded image is identical")
    p.add_argument("--compress", default="auto", choices=["auto", "true", "false"],
                   help="stream groups losslessly compressed (default auto: where the planner predicts it "
                        "faster; never on a CPU)")
    p.add_argument("--out", default=None, help="save the image here (PNG)")
    args = p.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 28)
    args.size = args.size or (16 if args.tiny else 1024)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not need_what_it_takes(args.tiny, device):
        return 2

    print("random weights (nothing downloaded): the image will be noise")
    pipe = build_pipeline(args.tiny, args.seed)
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    total = sum(t.numel() * t.element_size() for m in modules for t in m.state_dict().values())
    budget = args.gpu_memory or (total // 2 if args.tiny else "12GiB")
    reference = None
    if args.check:
        pipe.to(device)
        reference, ms = generate(pipe, args, device)
        print(f"resident: {sum(ms):.1f} ms for {len(ms)} steps")
        pipe.to("cpu")
    compress = {"auto": "auto", "true": True, "false": False}[args.compress]
    # ws.offload(pipe, gpu_memory=...) plans FluxPipeline's defaults (28 steps of 4096 + 512 tokens at
    # 1024x1024); offload_pipeline takes the steps and the transformer's tokens this run uses
    latent_tokens = (args.size // (2 * pipe.vae_scale_factor)) ** 2  # 2x2-packed latent pixels
    tokens = {"transformer": latent_tokens + configs(args.tiny)["t5_tokens"]}
    handle = offload_pipeline(pipe, budget, device=device, compress=compress, steps=args.steps, tokens=tokens)
    print(f"{ws.format_size(total)} of weights; {handle.stats}")
    image, ms = generate(pipe, args, device)
    for i, step in enumerate(ms):
        print(f"step {i + 1:3d}: {step:9.1f} ms")
    print(f"denoising: {sum(ms):.1f} ms for {len(ms)} steps ({sum(ms) / len(ms):.1f} ms per step); image "
          f"{tuple(image.shape)} (noise: random weights)")
    if args.out:
        from diffusers.image_processor import VaeImageProcessor

        VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(image))[0].save(args.out)
        print(f"saved {args.out}")
    handle.restore()
    if reference is not None:
        same = torch.equal(image, reference)
        print("identical to the resident pipeline's image" if same
              else "DIFFERS from the resident pipeline's image")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
