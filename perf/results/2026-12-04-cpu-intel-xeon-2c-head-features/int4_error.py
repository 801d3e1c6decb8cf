# Run from the repository root. Relative output error of int4 head weights (round-to-nearest vs range search) on random inputs.
import sys; sys.path.insert(0, '.'); sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parent))
import torch
torch.manual_seed(0)
import v_int4q as V
state = torch.load('demo/smollm2/eagle/pytorch_model.bin', weights_only=True)
x = torch.randn(2, 1536)
for k in ('fc.weight', 'layers.0.mlp.down_proj.weight', 'layers.0.mlp.gate_proj.weight', 'layers.0.self_attn.q_proj.weight'):
    w = state[k].to(torch.bfloat16)
    xi = torch.randn(2, w.shape[1]).to(torch.bfloat16)
    ref = xi.float() @ w.float().T
    from runtime.model import Int8Weight
    for name, f in (('int8', Int8Weight.of), ('rtn', V.v4.Int4Weight.of4), ('mse', V.of4_mse)):
        q = f(w)
        out = q.matmul(xi).float()
        print(k, name, f"rel out err {((out - ref).norm() / ref.norm()).item():.4f}")
