"""How far streamed Code2Wav audio is from the one-shot decode, and both from the exact
(float64) decode, on the built-in demo model. Prints one line per measurement.

    .venv/bin/python scripts/vocoder_stream_error.py [--frames 60] [--seed 0]
"""
import argparse
import copy

import torch

from omnivox.models.qwen3_omni.demo import demo_model_path
from omnivox.models.qwen3_omni.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    c2w = load_model(demo_model_path(), progress=False).code2wav
    c64 = copy.deepcopy(c2w).double()
    codes = torch.randint(0, 2048, (1, 16, args.frames), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        exact = c64(codes)[0, 0]
        one_shot = c2w(codes)[0, 0].double()
        state = c2w.init_state(1)
        streamed = torch.cat([c2w.decode_step(codes[:, :, t:t + 1], state)[0]
                              for t in range(args.frames)]).double()
        state64 = c64.init_state(1)
        streamed64 = torch.cat([c64.decode_step(codes[:, :, t:t + 1], state64)[0] for t in range(args.frames)])
    peak = exact.abs().max().item()
    print(f"frames {args.frames}, peak {peak:.3f}, samples {exact.numel()} (one frame per chunk)")
    print(f"float64 streamed vs one-shot : {(streamed64 - exact).abs().max().item():.2e}")
    print(f"float32 streamed vs one-shot : {(streamed - one_shot).abs().max().item():.2e}")
    print(f"float32 one-shot vs exact    : {(one_shot - exact).abs().max().item():.2e}")
    print(f"float32 streamed vs exact    : {(streamed - exact).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
