"""Offload a whole Flux.1-dev pipeline (CLIP + T5-XXL text encoders, the 12B transformer, the VAE) under one
GPU budget with weightstream, generate one image and print the milliseconds of each denoising step.

The pipeline is built here from the published configs with RANDOM weights (nothing is downloaded) and
in-memory word-level tokenizers, so the image is noise: the point is the memory and the step time.
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
import contextlib
import time

import torch

import weightstream as ws
from weightstream.pipeline import offload_pipeline


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def tokenizer(max_len: int):
    """A word-level tokenizer built in memory (no files): random weights need no real vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "a photo of an astronaut riding horse on the moon cat dog red blue".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", model_max_length=max_len)


def configs(tiny: bool) -> dict:
    """Constructor keywords of each component: FLUX.1-dev's published configs, or tiny ones."""
    if tiny:
        return dict(
            clip=dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, max_position_embeddings=16, projection_dim=16),
            t5=dict(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2,
                    feed_forward_proj="gated-gelu"),
            transformer=dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                             attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                             pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4)),
            vae=dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
                     down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                     norm_num_groups=4, layers_per_block=1, shift_factor=0.1159, scaling_factor=0.3611),
            clip_tokens=16, t5_tokens=16)
    return dict(
        clip=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                  hidden_act="quick_gelu"),
        t5=dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                feed_forward_proj="gated-gelu"),
        transformer=dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                         attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                         pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        vae=dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                 down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 norm_num_groups=32, layers_per_block=2, shift_factor=0.1159, scaling_factor=0.3611,
                 use_quant_conv=False, use_post_quant_conv=False),
        clip_tokens=77, t5_tokens=512)


def build_pipeline(tiny: bool, seed: int = 0, device: str | torch.device = "cpu"):
    """A FluxPipeline with random bf16 weights (each layer's default init) created on `device` (a GPU
    initializes FLUX.1-dev's 12B weights in seconds, a CPU in minutes), in eval mode."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    c = configs(tiny)
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(torch.bfloat16):
        clip = CLIPTextModel(CLIPTextConfig(**c["clip"], eos_token_id=2, pad_token_id=0, bos_token_id=1))
        t5 = T5EncoderModel(T5Config(**c["t5"], pad_token_id=0, eos_token_id=2))
        transformer = FluxTransformer2DModel(**c["transformer"])
        vae = AutoencoderKL(**c["vae"])
    for m in (clip, t5, transformer, vae):
        m.eval().requires_grad_(False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip,
                        tokenizer=tokenizer(c["clip_tokens"]), text_encoder_2=t5,
                        tokenizer_2=tokenizer(c["t5_tokens"]), transformer=transformer)


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
