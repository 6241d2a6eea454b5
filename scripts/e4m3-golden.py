# Writes reshard/tests/data/e4m3_torch.txt: blocks of bf16 values quantized by
# torch (torch.float8_e4m3fn of x / s, clamped to ±448; s = amax / 448 in f32),
# which reshard/tests/quant.rs checks reshard::quant against bit for bit.
# Run: python3 scripts/e4m3-golden.py > reshard/tests/data/e4m3_torch.txt (needs torch).
import torch, struct, sys
g = torch.Generator().manual_seed(7)
rows = []
for case in range(6):
    shape = [(3, 5), (17, 9), (130,), (4, 4), (2, 3, 7), (64,)][case]
    scale = [1.0, 1e-3, 300.0, 1e-30, 5.0, 1e5][case]
    x = (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
    if case == 3:
        x[0, 0] = 0.0; x[0, 1] = -0.0
    xf = x.float()
    amax = xf.abs().max()
    s = (amax / 448.0) if amax != 0 else torch.tensor(1.0)
    s = s.to(torch.float32)
    q = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    xb = x.view(torch.int16).flatten().tolist()
    qb = q.view(torch.uint8).flatten().tolist()
    sb = struct.unpack('<I', struct.pack('<f', s.item()))[0]
    rows.append((xb, sb, qb))
print(torch.__version__, file=sys.stderr)
for xb, sb, qb in rows:
    print(" ".join("%04x" % (v & 0xffff) for v in xb))
    print("%08x" % sb)
    print(" ".join("%02x" % v for v in qb))
