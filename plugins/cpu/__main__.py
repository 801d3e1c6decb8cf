"""`python -m plugins.cpu [--env LEVEL] [--build]`: this CPU's row of the README's support table, the dtype `auto`
picks, the environment that forces a lower level, and the C kernels built for it (a module of its own: the kernels'
build reads `plugins.cpu`)."""

from __future__ import annotations

import argparse

from plugins import cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins.cpu", description=cpu.__doc__.split("\n")[0])
    parser.add_argument("--env", metavar="LEVEL", choices=sorted(cpu.LEVELS),
                        help="print the environment (NAME=VALUE, one per line) that forces LEVEL, and exit")
    parser.add_argument("--build", action="store_true",
                        help="also build the C kernels for this level now (cached), and say which routes they take")
    args = parser.parse_args(argv)
    from plugins import native_build  # no torch: --env runs before torch should load

    try:
        cpu.features()
        native_build.emulation()
    except (cpu.CpuLevelError, ValueError) as exc:
        parser.error(str(exc))
    if args.env:
        print("\n".join(f"{k}={v}" for k, v in cpu.forced_env(args.env).items()))
        return 0
    print(cpu.features().describe())
    # the kernels only now: --env runs before torch should load
    from plugins.stream_linear import native as stream_linear

    missing = stream_linear.bf16_missing()  # builds the weight-streaming kernel (cached)
    print(f"dtype auto -> {'float32: ' + missing if missing else 'bfloat16: ' + stream_linear.bf16_route()}")
    if args.build:
        from plugins.decoder_layer import native as decoder_layer
        from plugins.draft_layer import native as draft_layer
        from plugins.rowwise import native as rowwise
        from plugins.tree_attention import native as attention

        for name, module, fallback in (
            ("weight-streaming matmul kernel", stream_linear, "torch's linear runs instead (slower; bf16 only where "
                                                              "native)"),
            ("attention kernel", attention, "bf16 models on CPU attend in float64 (slower)"),
            ("RMSNorm / RoPE / SiLU kernel", rowwise, "torch's ops run instead (slower)"),
            ("decoder layer kernel", decoder_layer, "the layer's torch ops run instead (slower)"),
            ("draft layer kernel", draft_layer, "int8 EAGLE heads draft through torch (slower)"),
        ):
            lib = module.load()
            print(f"{name}: built for {native_build.compiled_isa()}" if lib
                  else f"{name} unavailable ({module.unavailable()}): {fallback}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
