"""The walk of a task spec (#51): from `task_from_config`, the rooms (copes modules) the spec is handed to, read from
the real calls of a real build. A call is part of the walk when the orchestration makes it (`config.components`,
`tasks.plugins`) or when it calls back into the orchestration; what a builder does inside (a task reading its rows,
a reward module importing user code) is that builder's stay. The walk climbs back up when a lower room calls a
higher one, and returns when it enters a room it has left: once resolved in one pass (form, rewards, task), a spec
climbs 0 times and returns at most twice, whatever its form."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest

from copes.config.components import task_from_config
from copes.config.options import build_config

from helpers.paths import REPO

ORCHESTRATION = ("copes.config.components", "copes.tasks.plugins")
# Floors, highest first: a module matches the first prefix it starts with.
FLOORS = ("copes.config", "copes.tasks.plugins", "copes.tasks", "copes.rewards", "copes")


def _floor(module: str) -> int:
    return next(len(FLOORS) - i for i, prefix in enumerate(FLOORS)
                if module == prefix or module.startswith(prefix + "."))


def spec_walk(build: Callable[[], object]) -> tuple[list[str], int]:
    """(the rooms in the order the spec enters them, the climbs back up) of `build()`. Each call between two rooms
    is a hand-off; one room handing several things in a row to another (each reward spec to the reward room) is
    one hand-off."""
    walk: list[str] = []
    climbs, last_hand_off = 0, ("", "")

    def enter(room: str) -> None:
        if not walk or walk[-1] != room:
            walk.append(room)

    def profile(frame, event, arg):
        nonlocal climbs, last_hand_off
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_globals.get("__name__") or "", frame.f_back.f_globals.get("__name__") or ""
        if callee in ORCHESTRATION and not caller.startswith("copes."):
            enter(callee)  # the orchestration called from outside copes (a user's factory)
        if not callee.startswith("copes.") or not caller.startswith("copes."):
            return
        if (caller not in ORCHESTRATION and callee not in ORCHESTRATION) or (caller, callee) == last_hand_off:
            return
        if callee == caller:
            enter(callee)  # the orchestration's own next step, after a hand-off returned
            return
        climbs += _floor(callee) > _floor(caller)
        last_hand_off = (caller, callee)
        enter(caller)
        enter(callee)

    sys.setprofile(profile)
    try:
        build()
    finally:
        sys.setprofile(None)
    return walk, climbs


EXAMPLE = REPO / "examples" / "my_task"
FILE_OPTIONS = {"prompt_field": "problem", "answer_field": "solution", "eval_file": "eval.jsonl", "chat": False}
SPECS = {
    "built-in": ("arithmetic", {}, []),
    "built-in, a built-in reward": ("arithmetic", {}, ["exact"]),
    "built-in, two user rewards": ("arithmetic", {}, ["my_rewards:digit_credit", "my_rewards:carry_bonus"]),
    "file": ("train.jsonl", FILE_OPTIONS, []),
    "file, two user rewards": ("train.jsonl", FILE_OPTIONS, ["my_rewards:digit_credit", "my_rewards:carry_bonus"]),
    "plugin, a user reward": ("my_rewards:make_task", {}, ["my_rewards:digit_credit"]),
}


@pytest.mark.parametrize("form", SPECS)
def test_a_task_spec_climbs_back_up_never_and_returns_at_most_twice(form, tmp_path, monkeypatch):
    spec, options, rewards = SPECS[form]
    for name in ("train.jsonl", "eval.jsonl", "my_rewards.py"):
        (tmp_path / name).write_bytes((EXAMPLE / name).read_bytes())
    with (tmp_path / "my_rewards.py").open("a") as module:  # a plugin factory beside the rewards
        module.write("\n\ndef make_task(**options):\n    from copes.tasks.file_task import FileTask\n\n"
                     f"    return FileTask('train.jsonl', **{FILE_OPTIONS!r})\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = build_config({"task": spec, "task_options": options, "reward": rewards})
    walk, climbs = spec_walk(lambda: task_from_config(cfg))
    rendered = " > ".join(room.removeprefix("copes.") for room in walk)
    assert walk[0] == "copes.config.components", rendered
    assert climbs == 0, rendered
    assert len(walk) - len(set(walk)) <= 2, rendered
