"""Why compiled bf16 outputs can differ from the compiled resident model, and what closes the gap.

Runs a tiny bf16 Llama resident and offloaded, eager and compiled, with Inductor's
`emulate_precision_casts` off (the default) and on. Run: PYTHONPATH=src:tests python3 <this file>
"""

import copy

import torch
from conftest import make_model
from test_gpu import ids_for, streaming_all_budget

import weightstream as ws


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


for emulate in (False, True):
    torch._dynamo.reset()
    torch._inductor.config.emulate_precision_casts = emulate
    ref = make_model("llama", 0, torch.bfloat16).cuda()
    model = copy.deepcopy(ref)
    ws.offload(model, gpu_memory=streaming_all_budget(model), strategy="stream", tokens=2048)
    with torch.no_grad():
        e_ref, e_mod = ref(ids_for(0)).logits, model(ids_for(0)).logits
        c_ref = torch.compile(ref, fullgraph=True)(ids_for(0)).logits
        c_mod = torch.compile(model, fullgraph=True)(ids_for(0)).logits
    print(
        f"emulate_precision_casts={emulate}: eager equal {torch.equal(e_ref, e_mod)}; "
        f"compiled equal {torch.equal(c_ref, c_mod)} (max diff {max_diff(c_ref, c_mod):.3g}); "
        f"compiled offloaded vs eager {max_diff(c_mod, e_ref):.3g}; compiled resident vs eager "
        f"{max_diff(c_ref, e_ref):.3g}"
    )
