"""`omnivox ARGS` run in the test's own process: `omnivox.cli.main` with stdout and stderr
captured, its exit status as the shell would see it (argparse's SystemExit included).

For the checks a subprocess adds nothing to (usage errors, --help, one-line errors from main):
no interpreter start and no torch import per check. What a process alone shows (a server that
never returns, warnings printed once per process, the console script itself) stays in
subprocess tests."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
from unittest import mock


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """main(args) as `omnivox ARGS` would run it, OMNIVOX_DEBUG unset (errors stay one line) and
    `env` set for the call; returns (args, returncode, stdout, stderr) like subprocess.run. A
    `serve` never binds here: one that gets past its flag checks fails (exit 1, "error: internal:
    ...") instead of serving until killed. torch's thread count is put back after (`speak` sets
    its own, which a process would take with it when it exits)."""
    import torch

    from omnivox.cli import main

    threads, out, err = torch.get_num_threads(), io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch("omnivox.serve._bind", side_effect=_no_bind):
        os.environ.pop("OMNIVOX_DEBUG", None)  # (patch.dict puts back what was there)
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: usage errors (2), --help and --version (0)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _no_bind(host: str, port: int):
    raise AssertionError(f"in-process serve got past its flag checks to binding {host}:{port}")
