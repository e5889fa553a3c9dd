"""copes.config.components: what a run's settings build."""

from __future__ import annotations

import json
from pathlib import Path

from copes.config.components import tools_on
from copes.config.options import build_config
from copes.plan.memory import _task_uses_tools
from copes.tasks import get_task
from copes.tasks.file_task import FileTask


def test_a_users_file_task_has_no_tools_unless_asked(tmp_path: Path) -> None:
    """Unset --tools: copes' own chat tasks get the sandbox and search, a user's data file gets none (their
    instructions filled the prompt, and a 64-position model scored 0); --tools and --no-tools decide when given."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    mine, gsm8k = FileTask(str(data), chat=True), get_task("gsm8k", data_dir=tmp_path)
    assert [tools_on(None, mine), tools_on(True, mine), tools_on(False, mine)] == [False, True, False]
    assert [tools_on(None, gsm8k), tools_on(False, gsm8k)] == [True, False]
    assert not _task_uses_tools(build_config({"task": str(data)}))  # the memory plan agrees
    assert _task_uses_tools(build_config({"task": str(data), "tools": True}))
