"""``python -m kvcanary_cupy``: facts about this install, and a demo of the canary at work."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

DESCRIPTION = """\
kvcanary_cupy keeps a small canary buffer beside an LLM serving engine's paged KV cache. Every
written token is fingerprinted (token, position, a hash chain to its predecessor and a hash of the
real K/V bytes); before and after each forward pass the slots a batch reads are re-checked, and
any disagreement - a freed slot still in use, a table entry pointing at another request, a bit
flip in the KV, a token written with the wrong id or position - lands in a violation ring that
kc.Canary.poll() decodes into request, position and reason. Runs on CUDA GPUs (CuPy RawKernels)
and on the CPU (numba). Engines that refill their batch arrays in place bind a forward once
(kc.Canary.static_forward), whose launches a CUDA graph can capture with the model's forward.
Engines that drive the kernels themselves call kc.plan, kc.verify and kc.write, or kc.CanaryStep:
one forward's verify and write, validated once, one or two launches. KV moved to a host-memory
tier and back keeps its fingerprints through kc.copy_records (kc.Canary.copy_records when the
canary should know when its slots got them), so what changed while it was away is caught when it
is read again. Engines with block tables and cumulative int32 offsets (vLLM-style)
mirror their tables with kc.block_tables.mirror and build each batch with
kc.ForwardBatch.from_offsets."""


def _version() -> str:
    from . import __version__  # noqa: PLC0415

    return __version__


def _info(_: argparse.Namespace) -> int:
    import kvcanary_cupy as kc  # noqa: PLC0415
    from ._dlpack import (cuda_device_count, cupy_failure, cupy_module, error_text,  # noqa: PLC0415
                          import_error, installed_but_failing)

    print(f"kvcanary_cupy {kc.__version__}")
    numba_error = import_error("numba")
    if numba_error is None:
        import numba  # noqa: PLC0415

        print(f"  cpu backend : numba {numba.__version__}")
    else:
        why = installed_but_failing(numba_error, "numba")  # e.g. numba refusing the NumPy it finds
        print("  cpu backend : unavailable (" + ("numba is not installed: pip install numba" if why is None else
                                                 f"numba is installed but fails to import: {why}")
              + "; host arrays cannot be checked without it)")
    cupy = cupy_module()
    count = cuda_device_count()
    if cupy is None:
        why = cupy_failure()
        if why is None:
            print("  cuda backend: unavailable (CuPy is not installed: pip install cupy-cuda12x or cupy-cuda13x, "
                  "this package's cuda12 or cuda13 extra)")
        else:
            print(f"  cuda backend: unavailable (CuPy is installed but fails to import: {why})")
    elif count == 0:
        try:
            cupy.cuda.runtime.getDeviceCount()
            why = "no CUDA device is visible"
        except Exception as error:  # noqa: BLE001 - no driver, no device: CuPy's own words
            why = error_text(error)
        print(f"  cuda backend: CuPy {cupy.__version__}, 0 devices ({why}); arrays run on the CPU backend")
    else:
        print(f"  cuda backend: CuPy {cupy.__version__}, {count} device(s)")
    print("  devices     : cpu" + "".join(f", cuda:{i}" for i in range(count)))
    if cupy is not None:
        for i in range(count):
            try:
                props = cupy.cuda.runtime.getDeviceProperties(i)
                name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
                print(f"    cuda:{i}: {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB")
            except Exception:  # noqa: BLE001 - a device that cannot be queried is still listed
                pass
    return 0


def _compile(args: argparse.Namespace) -> int:
    import time  # noqa: PLC0415

    import kvcanary_cupy as kc  # noqa: PLC0415
    from ._dlpack import cuda_device_count, parse_device  # noqa: PLC0415

    if args.device is None:
        gpus = [f"cuda:{i}" for i in range(cuda_device_count())]
    else:  # a GPU named is treated as one seen, so --source-counts beside it is not dropped
        try:  # the CPU however it is spelt (CPU, " cpu"): not a GPU
            named = parse_device(args.device)
        except (TypeError, ValueError) as error:
            print(error, file=sys.stderr)
            return 2
        gpus = [args.device] if named.is_cuda else []
    # the CPU's builds, one for each number of hashed sources (CUDA kernels take any count)
    cpu_kernels = ("cpu", {} if args.source_counts is None else {"source_counts": args.source_counts}, "kernels")
    if not gpus:
        jobs = [cpu_kernels]
    elif args.source_counts is None:  # beside GPUs, the host side of kc.copy_records that a host tier runs
        jobs = [(gpu, {}, "kernels") for gpu in gpus] + [("cpu", {"source_counts": []}, "copy_records")]
    else:  # and the CPU backend's kernels asked for (copy_records among them)
        jobs = [(gpu, {}, "kernels") for gpu in gpus] + [cpu_kernels]
    for device, options, what in jobs:
        start = time.perf_counter()
        try:
            kc.compile_kernels(device=device, **options)
        except (RuntimeError, TypeError, ValueError) as error:
            print(error, file=sys.stderr)
            return 2
        print(f"{device}: {what} ready in {time.perf_counter() - start:.2f} s")
    return 0


def _counts(text: str) -> list[int]:
    """An argparse type: a comma-separated list of integers >= 0."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers >= 0 separated by commas, got {text!r}") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"must be integers >= 0 separated by commas, got {text!r}")
    return counts


def main(argv: Optional[list[str]] = None) -> int:
    # the same commands are installed on the path as `kvcanary`
    prog = "kvcanary" if os.path.basename(sys.argv[0]) == "kvcanary" else "python -m kvcanary_cupy"
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser("info", help="version, backends and devices available",
                               description="Print this package's version, the backends it can use (numba on the "
                                           "CPU; CuPy on CUDA GPUs) and the devices it sees.")
    info.set_defaults(handler=_info)
    compile_ = commands.add_parser(
        "compile", help="compile every kernel now (CuPy and numba cache them on disk: later processes only load them)",
        description="Compile and load every CUDA kernel for each device seen (or --device), or the CPU "
                    "backend's numba kernels when there is none, as kc.compile_kernels does: for a "
                    "container build or an engine's start-up, so that no forward waits for a compiler. "
                    "Beside GPUs it also readies the host side of kc.copy_records (a host tier's copies).")
    compile_.add_argument("--device", default=None,
                          help="cuda, cuda:N or cpu (default: every CUDA device seen, else cpu)")
    compile_.add_argument("--source-counts", type=_counts, default=None, metavar="N,N,...",
                          help="the CPU backend's kernels for canaries hashing these numbers of real-KV sources "
                               "(numba builds the hashing kernels once for each; 0 for hash mode NONE), e.g. 0,4 for "
                               "a host canary hashing K and V of two layers (default 0,1 where no GPU is compiled for; "
                               "beside GPUs the CPU builds are compiled only when this is given)")
    compile_.set_defaults(handler=_compile)
    from .sim import cli  # noqa: PLC0415

    demo = commands.add_parser("demo", help="simulate a serving engine, inject KV-cache faults, show what is caught",
                               description=cli.DESCRIPTION, epilog=cli.EPILOG)
    cli.add_arguments(demo)
    demo.set_defaults(handler=cli.run_from_args)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush finds a sink
        return 0


if __name__ == "__main__":
    sys.exit(main())
