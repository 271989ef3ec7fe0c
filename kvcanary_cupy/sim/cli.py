"""``python -m kvcanary_cupy demo``: run the serving simulator with faults and print what was caught."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from typing import Optional

from .._dlpack import cuda_device_count, parse_device
from .._layout import HashMode
from .engine import LAYOUTS, SMALLEST, SimConfig
from .faults import FAULT_CLASSES


def _faults(text: str) -> Optional[list[str]]:
    """An argparse type: the fault classes named, or ``None`` for 'all' (every class, injected where
    the engine's shape can host one, none of them demanded by ``--strict``)."""
    if any(not part.strip() for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"a fault class name is empty in {text!r}; name classes, 'all' or 'none'")
    names = [n for part in text.split(",") for n in part.split()]
    if len(names) > 1 and {"all", "none"} & set(names):  # else told as unknown classes
        raise argparse.ArgumentTypeError(f"'all' and 'none' stand alone, not among classes, got {text!r}")
    if names == ["all"]:
        return None
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in FAULT_CLASSES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault class(es) {unknown}; choose from {', '.join(FAULT_CLASSES)}")
    return names


def _at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def _probability(text: str) -> float:
    """An argparse type: a number within [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return value


def _device(text: str) -> str:
    """An argparse type: a device the package can name (whether it is there is told when it runs)."""
    try:
        parse_device(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}") from None
    return text.strip().lower()  # as the summary and the JSON name it, however it was spelt


def _output_path(text: str) -> str:
    """An argparse type: a file the run can write, checked before it runs rather than after."""
    if not text:
        raise argparse.ArgumentTypeError("must name a file, got ''")
    # the folder as open() will look for it: "x/" and "x/." name a file in folder x, and "a/../f"
    # needs folder a (abspath would normalise both away)
    folder = os.path.dirname(text) or os.curdir
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder!r} to write {text!r} in")
    try:
        os.stat(text)
        exists = True
    except FileNotFoundError:
        exists = False
    except OSError as error:  # a name longer than the file system takes, a loop of links: which exists() hides
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {error.strerror or error}") from None
    # a file that exists is written in place (its folder need not be writable: /dev/null, /dev/stdout);
    # a new one is created in its folder
    writable = os.access(text, os.W_OK) if exists else os.access(folder, os.W_OK | os.X_OK)
    if os.path.isdir(text) or not writable:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}")
    return text


def _one_file(first: str, second: str) -> bool:
    if os.path.exists(first) and os.path.exists(second):
        return os.path.samefile(first, second)
    return os.path.abspath(first) == os.path.abspath(second)


def _json_path(text: str) -> str:
    """``--json``'s path: a file, or ``-`` for standard output."""
    return text if text == "-" else _output_path(text)


def _chart_path(text: str) -> str:
    """``--chart``'s path: a PNG file, with matplotlib there to draw it, both told before the run."""
    path = _output_path(text)
    if not path.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"must end in .png (the chart is a PNG), got {text!r}")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib, not installed here: pip install matplotlib (this "
                                         "package's plot extra)")
    return path


DESCRIPTION = ("Simulate a serving engine, inject KV-cache faults and show which ones the canary catches, "
               "how fast, and at what cost.")
EPILOG = ("Exit status: 0 a clean run; 1 a false positive (a violation no injected fault explains) or, with "
          "--strict, a missed fault or a named class not caught; 2 a refused option or, after an otherwise clean "
          "run, an output that could not be written.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options, for a parser of its own or a ``demo`` subcommand."""
    parser.add_argument("--device", type=_device, default=None,
                        help="cpu, cuda or cuda:N (default: cuda if a GPU is seen)")
    parser.add_argument("--steps", type=_at_least(SMALLEST["steps"]), default=300,
                        help="forward passes to simulate (default 300)")
    parser.add_argument("--seed", type=_at_least(SMALLEST["seed"]), default=0,
                        help="workload and fault seed (default 0)")
    parser.add_argument("--faults", type=_faults, default=None, metavar="CLASSES",
                        help="comma-separated fault classes, 'all' (default: each class in turn where the engine's "
                             "shape can host it) or 'none': " + ", ".join(FAULT_CLASSES)
                             + "; with --strict each class named must be caught")
    parser.add_argument("--fault-every", type=_at_least(1), default=10, help="steps between injected faults (default 10)")
    parser.add_argument("--hash-mode", default="all", choices=[m.name.lower() for m in HashMode],
                        help="how much real KV each slot fingerprints (default all: every fault class is "
                             "visible; partial, the cheaper production mode, hashes the first 16 bytes of each "
                             "slot in each hashed KV buffer, so a bit flipped past them goes unseen: see "
                             "docs/detection.md)")
    parser.add_argument("--layout", default="paged", choices=LAYOUTS, help="KV pool layout (default paged)")
    parser.add_argument("--pool-slots", type=_at_least(1), default=8192,
                        help=f"KV slots in the pool, rounded down to whole pages (default 8192; at least one "
                             f"request of {SimConfig.max_len} tokens in pages, beside the padding page: "
                             f"{SimConfig.max_len + 16} with pages of 16)")
    parser.add_argument("--page-size", type=_at_least(SMALLEST["page_size"]), default=16,
                        help="tokens per page (default 16)")
    parser.add_argument("--max-running", type=_at_least(SMALLEST["max_running"]), default=16,
                        help="concurrent requests (default 16)")
    parser.add_argument("--swa-window", type=_at_least(SMALLEST["swa_window"]), default=0,
                        help="add a sliding-window group of this window (default 0: none)")
    parser.add_argument("--host-slots", type=_at_least(SMALLEST["host_slots"]), default=2048,
                        help="slots of a host-memory KV tier that requests are offloaded to now and then and "
                             "loaded back from, their canary records carried with them, rounded up to whole pages (default "
                             f"2048; 0: none; else more than a request's {SimConfig.max_len} tokens)")
    parser.add_argument("--offload-prob", type=_probability, default=None,
                        help="chance that a step offloads a running request to the host tier (default "
                             f"{SimConfig.offload_prob}; above 0 not with --host-slots 0)")
    parser.add_argument("--sweep-every", type=_at_least(SMALLEST["sweep_every"]), default=16,
                        help="steps between sweeps of all live requests (default 16; 0: none)")
    parser.add_argument("--no-expected-checks", action="store_true",
                        help="turn off the expected-token checks (token_swap then goes unseen)")
    parser.add_argument("--split-batches", action="store_true",
                        help="prefill and decode forwards take turns instead of sharing forwards")
    parser.add_argument("--static-decode", action="store_true",
                        help="run decode forwards as a CUDA-graph engine does (implies --split-batches): padded to "
                             "the next batch size (powers of two below --max-running, and --max-running), over "
                             "input arrays refilled in place, the canary's part bound once per size "
                             "(kc.StaticForward) and, on a GPU, replayed as CUDA graphs")
    parser.add_argument("--speculative", type=_at_least(SMALLEST["speculative"]), default=0, metavar="DRAFTS",
                        help="speculative decoding: each decoding request's forward verifies this many drafted "
                             f"tokens (a chain, each wrong with chance {SimConfig.draft_miss}) and keeps those the "
                             "target accepts, the only ones the canary fingerprints (default 0: none; not with "
                             "--static-decode)")
    parser.add_argument("--json", type=_json_path, metavar="PATH",
                        help="write the results as JSON (- : to standard output, the summary then to standard error)")
    parser.add_argument("--chart", type=_chart_path, metavar="PATH.png",
                        help="write a PNG chart (needs matplotlib: this package's plot extra)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 also when an injected fault went unreported although its requests were done "
                             "with before the run ended, or when a class named in --faults was never caught (not "
                             "injected, or each of its faults missed, in flight at the end or without effect; 'all' "
                             "names no class)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    if args.offload_prob and not args.host_slots:  # asked for offloads with nowhere to offload to
        raise ValueError(f"kv-canary: offload_prob needs a host tier (host_slots > 0), got "
                         f"offload_prob={args.offload_prob} with host_slots=0")
    offload_prob = SimConfig.offload_prob if args.offload_prob is None else args.offload_prob
    device = args.device or ("cuda" if cuda_device_count() > 0 else "cpu")
    return SimConfig(steps=args.steps, seed=args.seed, device=device, hash_mode=HashMode[args.hash_mode.upper()],
                     layout=args.layout, pool_slots=args.pool_slots, page_size=args.page_size,
                     max_running=args.max_running, swa_window=args.swa_window, sweep_every=args.sweep_every,
                     expected_checks=not args.no_expected_checks, split_batches=args.split_batches,
                     static_decode=args.static_decode, host_slots=args.host_slots,
                     offload_prob=offload_prob, speculative=args.speculative)


# the canary's capacities the engine asks for (and the settings it refuses when they do not fit in
# memory), and the demo's options that set them
_SET_BY = {"req_to_token_pool_size": "--max-running", "pool_slot_count": "--pool-slots and --page-size",
           "max_prefill_tokens": "--max-running and --speculative", "speculative_num_draft_tokens": "--speculative",
           "host_slots": "--host-slots"}


def run_from_args(args: argparse.Namespace) -> int:
    from .runner import run  # noqa: PLC0415

    if args.json and args.chart and _one_file(args.json, args.chart):  # the chart would be written over the JSON
        print(f"kv-canary: --json and --chart must name two files, got {args.json!r} and {args.chart!r}",
              file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as error:  # the simulator's own names for its settings, said as the flags that set them
        flags = {name: "--" + name.replace("_", "-") for name in vars(args)}
        print(re.sub(r"\b[a-z_]+\b", lambda word: flags.get(word[0], word[0]), str(error)), file=sys.stderr)
        return 2
    try:
        faults = list(FAULT_CLASSES) if args.faults is None else args.faults
        result = run(config, faults, fault_every=args.fault_every,
                     progress=not args.no_progress and sys.stderr.isatty())
    except (RuntimeError, ValueError) as error:
        if not str(error).startswith("kv-canary: "):
            raise
        # e.g. --device cuda without CuPy: one line, not a traceback; a capacity of the canary's
        # said with the options that set it
        name = str(error)[len("kv-canary: "):].split(" ", 1)[0]
        print(str(error) + (f" (set by {_SET_BY[name]})" if name in _SET_BY else ""), file=sys.stderr)
        return 2
    except MemoryError:
        print("kv-canary: the simulated engine does not fit in this machine's memory: lower --pool-slots, "
              "--max-running, --host-slots or --page-size", file=sys.stderr)
        return 2
    # a class named and never caught is one the run did not show the canary catching
    uncaught = result.uncaught(args.faults or ()) if args.strict else {}
    failed = bool(result.false_positives) or (args.strict and bool(result.missed or uncaught))
    summary_to = sys.stderr if args.json == "-" else sys.stdout  # standard output carries the JSON then
    try:
        print(result.summary(), file=summary_to, flush=True)
        wrote = _write_outputs(result, args, summary_to)
    except BrokenPipeError:  # e.g. piped into head: the reader has what it wanted, the status still tells
        sys.stderr.close()
        return 1 if failed else 0
    if failed:  # said, and told by the status, whether or not the outputs could be written
        print(f"kv-canary: demo failed: {len(result.false_positives)} false positive(s)"
              + (f", {len(result.missed)} missed fault(s)" if args.strict else "")
              + "".join(f"; {cls} asked for, never caught ({why})" for cls, why in uncaught.items()), file=sys.stderr)
        return 1
    return 0 if wrote else 2


def _write_outputs(result, args: argparse.Namespace, say_to) -> bool:
    """Write ``--json`` and ``--chart``, each said on ``say_to``; False when one cannot be."""
    writing = args.json
    try:
        if args.json == "-":
            json.dump(result.to_json(), sys.stdout, indent=2)
            print(flush=True)
        elif args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(result.to_json(), handle, indent=2)
            print(f"wrote {args.json}", file=say_to)
        writing = args.chart
        if args.chart:
            from .chart import write_chart  # noqa: PLC0415

            if not write_chart(result, args.chart):
                print("kv-canary: cannot write the chart: matplotlib does not import", file=sys.stderr)
                return False
            print(f"wrote {args.chart}", file=say_to)
    except BrokenPipeError:
        raise
    except OSError as error:  # the folder was writable when the run began
        print(f"kv-canary: cannot write {writing}: {error.strerror or error}", file=sys.stderr)
        return False
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcanary_cupy demo", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
