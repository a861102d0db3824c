"""Run many `reputd` command lines fast, each as its own process: `python -m tests.cli_table` reads a JSON
list of cases ({"argv", "env", "cwd", "timeout", "group"}) on stdin and prints one JSON result per case ({"code",
"stdout", "stderr", "timedOut", "seconds"}).

The driver imports reputd's modules once, then forks a child per case, which does what `python -m
daemon.cli` does (`sys.exit(main())` with the case's argv, environment, directory and its own stdout and
stderr files) and nothing else: the real command line, its exit code and its output, without an
interpreter's start-up per case (~0.3 s of CPU each, against a few ms for a fork). A case still running at
its timeout is killed and reported as such. Cases run two at a time, never two of one group; results come
in the cases' order.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

PARALLEL = 2  # cases at once: most of a case is CPU, and CI machines have two cores at least


def _preload() -> None:
    """What the commands import when they run, imported here once, before any fork."""
    import daemon.cli
    import daemon.cli.common
    import daemon.commands.handoff
    import daemon.commands.inspect_file
    import daemon.commands.produce
    import daemon.commands.query
    import daemon.commands.verify
    import daemon.commands.verify_text
    import daemon.engine.reput
    import daemon.engine.sizes
    import daemon.ops.logs  # noqa: F401


def _child(case: dict, out_fd: int, err_fd: int) -> None:
    """In the forked child: become the command line of `case` and exit with its code."""
    code = 99
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.argv = ["reputd", *case["argv"]]
        from daemon.cli import main

        code = main()
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 99
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class _Running:
    """One forked case: its files, its start and its deadline."""

    def __init__(self, case: dict):
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed by result()
        self.group = case.get("group", object())
        self.started = time.monotonic()
        self.deadline = self.started + case.get("timeout", 60)
        self.pid = os.fork()
        if self.pid == 0:
            _child(case, self.out.fileno(), self.err.fileno())

    def result(self, status: int, timed_out: bool) -> dict:
        with self.out, self.err:
            self.out.seek(0)
            self.err.seek(0)
            return {"code": os.waitstatus_to_exitcode(status), "stdout": self.out.read().decode(errors="replace"),
                    "stderr": self.err.read().decode(errors="replace"), "timedOut": timed_out,
                    "seconds": round(time.monotonic() - self.started, 3)}


def run_cases(cases: list[dict], parallel: int = PARALLEL):
    """Yield each case's result, in the order of `cases`, running up to `parallel` at once, but never two of
    one `group` (cases that write the same directory, which one writer at a time may hold)."""
    results: dict[int, dict] = {}
    running: dict[int, tuple[int, _Running]] = {}
    pending = list(enumerate(cases))
    emitted = 0
    while emitted < len(cases):
        busy = {child.group for _, child in running.values()}
        for item in list(pending):
            if len(running) >= parallel:
                break
            if item[1].get("group") in busy:
                continue
            pending.remove(item)
            child = _Running(item[1])
            running[child.pid] = (item[0], child)
            busy.add(child.group)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            n, child = running.pop(pid)
            results[n] = child.result(status, False)
        else:
            for pid, (n, child) in list(running.items()):
                if time.monotonic() > child.deadline:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    del running[pid]
                    results[n] = child.result(status, True)
            time.sleep(0.002)
        while emitted in results:
            yield results.pop(emitted)
            emitted += 1


def main() -> None:
    cases = json.load(sys.stdin)
    _preload()
    for result in run_cases(cases):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
