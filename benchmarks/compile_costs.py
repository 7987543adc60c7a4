"""What ``torch.compile`` costs and pays on the built-in ``resnet`` workload, on one thread.

Each mode runs in a fresh process (nothing compiled, imported or cached in memory
carries over) and trains the default ``resnet`` model (or ``--width`` / ``--blocks``)
for ``--epochs`` epochs at batch 64 on 3,000 MNIST images, timing each epoch's
training pass and, apart, its evaluation on the 1,000 validation images:

- ``eager``: the plain module;
- ``channels_last``: the module and every batch in channels-last memory format;
- ``compile-cold``: ``torch.compile(model)`` (default mode) with a fresh, empty
  inductor cache (``TORCHINDUCTOR_CACHE_DIR`` set to a new folder before torch is
  imported): epoch 1 pays the compile, epochs 2.. are the steady rate;
- ``compile-warm``: the same in a new process reusing ``compile-cold``'s cache folder;
- ``compile-cl-cold``: compiled and channels-last, with its own fresh cache;
- ``compile-static-cold`` (not run unless named): ``torch.compile(model,
  dynamic=False)``, fresh cache: the last, smaller batch gets a static graph of its
  own instead of the dynamic-batch graph dynamo makes by default on a second shape.

The loop is the workload's own (shuffled ``DataLoader``, ``zero_grad``, cross-entropy,
``backward``, SGD ``step``), written out here so that it measures ``torch.compile``
itself, apart from how pipetune applies its ``compile`` and ``channels_last`` knobs
(and with no pipetune compile cache in play). The model is compiled as a wrapper;
the checkpoint is the original module's ``state_dict`` (the wrapper's keys carry an
``_orig_mod.`` prefix), which this script saves and loads back into a fresh model.
``graphs`` counts the graphs dynamo compiled during an epoch (training, then
evaluation): the last, smaller batch of an epoch makes a second one. ``first`` and
``last`` are the wall times of epoch 1's first and last training steps (the compile
and that recompile, when compiled).

    python benchmarks/compile_costs.py [--epochs 3] [--threads 1] [--modes eager,...]
        [--width 24 --blocks 2] [--data /path/to/mnist | --data digits] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("eager", "channels_last", "compile-cold", "compile-warm", "compile-cl-cold",
         "compile-static-cold")
DEFAULT_MODES = MODES[:5]


def default_data() -> str:
    """The MNIST IDX folder under the data root, or ``digits`` when it is absent."""
    root = os.environ.get("PIPETUNE_DATASETS") or str(ROOT.parent / "shared" / "datasets")
    mnist = Path(root) / "mnist"
    return str(mnist) if mnist.is_dir() else "digits"


# -- the child: one mode, one process --------------------------------------------------------
def tree_cpu_seconds() -> float:
    """CPU seconds of this process and its children, live ones included (inductor
    compiles in a pool of worker processes)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for kid in me.children(recursive=True):
        try:
            k = kid.cpu_times()
        except psutil.Error:
            continue
        total += k.user + k.system
    return total


def child(args: argparse.Namespace) -> dict:
    """Train in this process under ``args.child`` and return its timings."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from pipetune.workloads._classifier import _mix_seed
    from pipetune.workloads.resnet import ResNetWorkload, build_resnet

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    mode = args.child
    compiled = mode.startswith("compile")
    channels_last = mode in ("channels_last", "compile-cl-cold")
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    if args.data == "digits":
        data_params = {"dataset": "digits", "train_samples": min(args.train_samples, 1400),
                       "val_samples": min(args.val_samples, 397)}
    else:
        data_params = {"dataset": "idx", "data_dir": args.data,
                       "train_samples": args.train_samples, "val_samples": args.val_samples}
    workload = ResNetWorkload(width=args.width, blocks=args.blocks, **data_params)
    workload.setup({"batch_size": args.batch_size, "lr": 0.05}, seed=0)
    model, optimizer, data = workload._model, workload._optimizer, workload.data
    assert model is not None and optimizer is not None
    model.to(memory_format=fmt)
    if not compiled:
        run = model
    elif mode == "compile-static-cold":
        run = torch.compile(model, dynamic=False)
    else:
        run = torch.compile(model)
    counters = None
    if compiled:
        from torch._dynamo.utils import counters

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"]) if counters is not None else 0

    epochs = []
    for epoch in range(args.epochs):
        loader = DataLoader(
            TensorDataset(data.train_x, data.train_y), batch_size=args.batch_size,
            shuffle=True, generator=torch.Generator().manual_seed(_mix_seed(0, epoch)),
        )
        g0, c0, t0 = graphs(), tree_cpu_seconds(), time.perf_counter()
        model.train()
        step_seconds = []
        for x, y in loader:
            step_started = time.perf_counter()
            x = x.contiguous(memory_format=fmt)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(run(x).float(), y)
            loss.backward()
            optimizer.step()
            step_seconds.append(time.perf_counter() - step_started)
        train_s, train_cpu = time.perf_counter() - t0, tree_cpu_seconds() - c0
        g1, t1 = graphs(), time.perf_counter()
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(data.val_x), workload.eval_batch_size):
                x = data.val_x[start:start + workload.eval_batch_size].contiguous(
                    memory_format=fmt)
                y = data.val_y[start:start + workload.eval_batch_size]
                correct += int((run(x).argmax(dim=1) == y).sum())
        eval_s = time.perf_counter() - t1
        epochs.append({"train_s": train_s, "train_cpu_s": train_cpu, "eval_s": eval_s,
                       "first_step_s": step_seconds[0], "last_step_s": step_seconds[-1],
                       "train_graphs": g1 - g0, "eval_graphs": graphs() - g1,
                       "accuracy": correct / len(data.val_x)})

    # The checkpoint: the original module's state_dict, loadable into a fresh model.
    prefixed = any(k.startswith("_orig_mod.") for k in run.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(model.state_dict(), Path(tmp) / "model.pt")
        fresh = build_resnet(data.num_classes, args.width, args.blocks)
        fresh.load_state_dict(torch.load(Path(tmp) / "model.pt", weights_only=True))
    return {"mode": mode, "epochs": epochs, "wrapper_keys_prefixed": prefixed,
            "torch": torch.__version__, "train_samples": len(data.train_x),
            "data": data_params["dataset"]}


# -- the parent: one process per mode, then the table -----------------------------------------
def run_mode(args: argparse.Namespace, mode: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
           "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, __file__, "--child", mode, "--epochs", str(args.epochs),
           "--threads", str(args.threads), "--width", str(args.width),
           "--blocks", str(args.blocks), "--batch-size", str(args.batch_size),
           "--train-samples", str(args.train_samples), "--val-samples", str(args.val_samples),
           "--data", args.data]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        return {"mode": mode, "error": f"exit {done.returncode}: {tail}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def table(results: list[dict]) -> str:
    head = (f"{'mode':19} {'epoch 1':>8} {'steady':>8} {'1-steady':>8} {'first':>6} "
            f"{'last':>6} {'cpu 1':>7} {'eval 1':>7} {'eval st':>7} {'graphs':>12} "
            f"{'acc':>6} {'process':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:19} failed: {r['error']}")
            continue
        ep = r["epochs"]
        later = ep[1:] or ep
        steady = sum(e["train_s"] for e in later) / len(later)
        eval_steady = sum(e["eval_s"] for e in later) / len(later)
        graphs = "/".join(f"{e['train_graphs']}+{e['eval_graphs']}" for e in ep)
        lines.append(
            f"{r['mode']:19} {ep[0]['train_s']:8.2f} {steady:8.2f} "
            f"{ep[0]['train_s'] - steady:8.2f} {ep[0]['first_step_s']:6.2f} "
            f"{ep[0]['last_step_s']:6.2f} {ep[0]['train_cpu_s']:7.2f} "
            f"{ep[0]['eval_s']:7.2f} {eval_steady:7.2f} {graphs:>12} "
            f"{ep[-1]['accuracy']:6.3f} {r['process_s']:8.1f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=None, help="default: the workload's")
    parser.add_argument("--blocks", type=int, default=None, help="default: the workload's")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-samples", type=int, default=3000)
    parser.add_argument("--val-samples", type=int, default=1000)
    parser.add_argument("--data", default=None,
                        help="MNIST IDX folder, or 'digits' (default: $PIPETUNE_DATASETS/mnist "
                        "or ../shared/datasets/mnist, else digits)")
    parser.add_argument("--cache-dir", default=None,
                        help="parent folder of the inductor caches (default: a new temp folder, "
                        "removed at the end)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from pipetune.workloads.resnet import ResNetWorkload

    args.width = args.width or ResNetWorkload.param_defaults["width"]
    args.blocks = args.blocks or ResNetWorkload.param_defaults["blocks"]
    args.data = args.data or default_data()
    if args.child:
        print(json.dumps(child(args)))
        return 0

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    parent = Path(args.cache_dir or tempfile.mkdtemp(prefix="pipetune-compile-costs-"))
    caches = {"compile-cold": parent / "plain", "compile-warm": parent / "plain",
              "compile-cl-cold": parent / "channels-last",
              "compile-static-cold": parent / "static"}
    for mode in ("compile-cold", "compile-cl-cold", "compile-static-cold"):  # cold: empty
        if mode in modes:
            shutil.rmtree(caches[mode], ignore_errors=True)
    load = os.getloadavg()[0]
    results = []
    for mode in modes:
        cache = caches.get(mode, parent / "unused")
        cache.mkdir(parents=True, exist_ok=True)
        results.append(run_mode(args, mode, str(cache)))
        print(f"  {mode}: done", file=sys.stderr, flush=True)
    ok = next((r for r in results if "error" not in r), {})
    print(f"resnet width={args.width} blocks={args.blocks}, batch {args.batch_size}, "
          f"{ok.get('train_samples', '?')} {ok.get('data', '?')} training images, "
          f"{args.threads} thread(s), torch {ok.get('torch', '?')}; load average "
          f"{load:.2f} -> {os.getloadavg()[0]:.2f}")
    print("seconds of wall time, training pass ('eval': the validation pass apart); "
          "'steady' = mean of epochs 2..; 'cpu 1' = CPU seconds of epoch 1's training, "
          "process tree; 'graphs' = graphs dynamo compiled per epoch, training+evaluation")
    print(table(results))
    prefixed = [r["mode"] for r in results if r.get("wrapper_keys_prefixed")]
    if prefixed:
        print(f"compiled wrapper's state_dict keys carry '_orig_mod.' ({', '.join(prefixed)}); "
              f"the original module's state_dict was saved and loaded back")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.cache_dir:
        shutil.rmtree(parent, ignore_errors=True)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
