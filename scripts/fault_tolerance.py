"""Run a fault-tolerant job on one machine: a torchft lighthouse and N replica groups, each its own torchrun.

    python scripts/fault_tolerance.py --groups 2 --nproc 2 -- --config llama3_debug.toml

Everything after ``--`` goes to every group's ``train.py``; the launcher adds the ``[fault_tolerance]`` keys
(enable, group_size, replica_id, lighthouse). The job's folder is the config's ``[job] dump_folder`` (or
``-- --job.dump_folder X``, or ``--dump-folder X``: not both with different values). Each group logs to
``<dump>/replica_<g>/`` (its console output in ``launch_<attempt>.log``); checkpoints are shared in ``<dump>``.
The config is checked before anything starts (one line and exit 2 on a mistake, as ``train.py`` does); a group
that fails with one of ``train.py``'s one-line errors (a missing file, a corrupt checkpoint, ...) is not restarted
(the relaunch would meet it again), and that line is repeated on the launcher's console.

``--restart K`` relaunches a group that died, up to K times; it rejoins by receiving the live weights from a
peer. ``--kill G:STEP:WHEN`` rehearses a failure: group G's next launch stops at STEP (``between``: after it
committed STEP, before the next step; ``allreduce``: inside the cross-group all-reduce of the next step, after
its first bucket) and the launcher SIGKILLs its whole process tree there. Repeat it for several failures; each
launch of G takes the next one. ``--hold G:STEP`` makes group G wait from STEP on until every group is live, so
that in a short rehearsal the restarted group rejoins before the others finish. The events (launches, kills,
first steps, exits) go to ``<dump>/launcher_events.json``.

On a cluster the lighthouse runs once (``torchft_lighthouse --min_replicas 1 --bind [::]:29510``) and every group
is one torchrun (or one slurm job step) with ``--fault_tolerance.replica_id`` set; see the README.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAILURE_ENV = "TITAN_SIMPLE_FT_FAIL"  # read by titan_simple/trainer/fault_tolerance.py
USAGE_ERROR = 2  # a bad argument or config, as train.py exits on one


class UsageError(Exception):
    """A bad launcher argument or config: one line, exit 2."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (torchrun starts its workers in sessions of their own, so killing
    torchrun's process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def kill_tree(pid: int) -> None:
    for member in process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def lighthouse_binary() -> str:
    """``torchft_lighthouse`` next to this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise UsageError("torchft_lighthouse not found: install the ft extra (scripts/setup.sh does) or pass "
                         "--lighthouse ADDRESS of a running one.")
    return found


@dataclass
class Group:
    index: int
    kills: list[tuple[int, str]]  # (step, when) for its successive launches
    hold: int | None = None  # --hold: from this step on, the group steps only with every group live
    process: subprocess.Popen | None = None
    attempt: int = 0
    restarts_left: int = 0
    failure: tuple[int, str] | None = None  # the failure this launch was told to stop at
    lines_at_launch: int = 0  # metrics.jsonl lines before this launch: the next one is its first step
    first_step_seen: bool = False
    lines_seen: int = 0
    step_times: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, step) as logged
    exit_codes: list[int] = field(default_factory=list)


class Launcher:
    def __init__(self, args: argparse.Namespace, train_args: list[str]) -> None:
        self.args, self.train_args = args, train_args
        self.dump = job_folder(args, train_args)
        self.started = time.monotonic()
        self.events: list[dict] = []
        kills: dict[int, list[tuple[int, str]]] = {g: [] for g in range(args.groups)}
        for spec in args.kill:
            group, step, when = (spec.split(":") + ["", "", ""])[:3]
            if not group.isdigit() or int(group) not in kills or not step.isdigit() or when not in (
                    "between", "allreduce") or spec.count(":") != 2:
                raise UsageError(f"--kill {spec}: expected GROUP:STEP:between|allreduce with GROUP < {args.groups}")
            kills[int(group)].append((int(step), when))
        holds: dict[int, int] = {}
        for spec in args.hold:
            group, _, step = spec.partition(":")
            if not group.isdigit() or int(group) >= args.groups or not step.isdigit():
                raise UsageError(f"--hold {spec}: expected GROUP:STEP with GROUP < {args.groups}")
            holds[int(group)] = int(step)
        self.groups = [Group(g, kills[g], holds.get(g), restarts_left=args.restart) for g in range(args.groups)]
        self.lighthouse_process: subprocess.Popen | None = None

    def event(self, kind: str, **details: object) -> None:
        entry = {"t": round(time.monotonic() - self.started, 3), "event": kind, **details}
        self.events.append(entry)
        print(f"[launcher {entry['t']:8.2f}s] {kind} " + " ".join(f"{k}={v}" for k, v in details.items()),
              flush=True)

    def start_lighthouse(self) -> str:
        if self.args.lighthouse:
            return self.args.lighthouse
        port = self.args.lighthouse_port or free_port()
        log = open(self.dump / "lighthouse.log", "a")  # noqa: SIM115 -- lives as long as the lighthouse
        self.lighthouse_process = subprocess.Popen(
            [lighthouse_binary(), "--min_replicas", str(self.args.min_replicas), "--bind", f"[::]:{port}",
             "--join_timeout_ms", str(self.args.join_timeout_ms),
             "--heartbeat_timeout_ms", str(self.args.heartbeat_timeout_ms)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        if not wait_for_port(port, 30):
            raise UsageError(f"the lighthouse did not start on port {port}; see {self.dump / 'lighthouse.log'}")
        self.event("lighthouse", port=port)
        return f"http://127.0.0.1:{port}"

    def launch(self, group: Group, lighthouse: str) -> None:
        folder = self.dump / f"replica_{group.index}"
        folder.mkdir(parents=True, exist_ok=True)
        for marker in folder.glob("failure_point.rank*"):
            marker.unlink()
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop(FAILURE_ENV, None)
        group.failure = group.kills[group.attempt] if group.attempt < len(group.kills) else None
        group.lines_at_launch, group.first_step_seen = len(self.metrics_lines(group)), False
        group.lines_seen = group.lines_at_launch
        directives = [f"{group.failure[1]}:{group.failure[0]}"] if group.failure is not None else []
        if group.hold is not None:
            directives.append(f"hold:{group.hold}")
        if directives:
            env[FAILURE_ENV] = ",".join(directives)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.args.nproc}",
                   "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(REPO / "train.py"),
                   *self.train_args, "--job.dump_folder", str(self.dump),
                   *group_args(self.args.groups, group.index, lighthouse)]
        log = open(folder / f"launch_{group.attempt}.log", "w")  # noqa: SIM115 -- closed with the process
        group.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.event("launch", group=group.index, attempt=group.attempt,
                   failure=env.get(FAILURE_ENV, ""))

    def say_error(self, group: Group) -> str | None:
        """Repeat a failed launch's ``error:`` line (train.py's one-line errors) on the launcher's console and return
        it; None if the launch died without one (killed, crashed)."""
        log = self.dump / f"replica_{group.index}" / f"launch_{group.attempt}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        errors = [line.strip() for line in lines if line.startswith("error:")]
        if errors:
            print(f"[launcher] group {group.index}: {errors[-1]} (its log: {log})", flush=True)
            return errors[-1]
        return None

    def metrics_lines(self, group: Group) -> list[str]:
        path = self.dump / f"replica_{group.index}" / "metrics.jsonl"
        return path.read_text().splitlines() if path.exists() else []

    def note_steps(self, group: Group) -> None:
        """When each step of the group appeared in its metrics (to 50 ms), and an event when a launch logs its first
        step (how long a restarted group took to rejoin)."""
        if group.process is None:
            return
        lines = self.metrics_lines(group)
        now = round(time.monotonic() - self.started, 3)
        for line in lines[group.lines_seen:]:
            try:
                group.step_times.append((now, json.loads(line)["step"]))
            except (ValueError, KeyError):
                pass
        group.lines_seen = len(lines)
        if not group.first_step_seen and len(lines) > group.lines_at_launch:
            group.first_step_seen = True
            try:
                step = json.loads(lines[group.lines_at_launch])["step"]
            except (ValueError, KeyError):
                step = None
            self.event("first_step", group=group.index, attempt=group.attempt, step=step)

    def kill_if_paused(self, group: Group) -> None:
        """SIGKILL the group's process tree once every rank stopped at its failure point."""
        if group.failure is None or group.process is None or group.process.poll() is not None:
            return
        folder = self.dump / f"replica_{group.index}"
        if len(list(folder.glob("failure_point.rank*"))) < self.args.nproc:
            return
        kill_tree(group.process.pid)
        group.process.wait()
        self.event("killed", group=group.index, at=f"{group.failure[1]}:{group.failure[0]}")

    def run(self) -> int:
        self.dump.mkdir(parents=True, exist_ok=True)
        lighthouse = self.start_lighthouse()
        for group in self.groups:
            self.launch(group, lighthouse)
        try:
            while any(g.process is not None for g in self.groups):
                for group in self.groups:
                    self.note_steps(group)
                    self.kill_if_paused(group)
                    if group.process is None or (code := group.process.poll()) is None:
                        continue
                    group.exit_codes.append(code)
                    self.note_steps(group)  # the lines written just before it exited
                    group.process = None
                    self.event("exit", group=group.index, attempt=group.attempt, code=code)
                    error = self.say_error(group) if code != 0 else None
                    group.attempt += 1
                    if error is not None:  # train.py's one-line error (config, checkpoint): a relaunch meets it again
                        self.event("not_restarted", group=group.index, why=error)
                    elif code != 0 and group.restarts_left > 0:
                        group.restarts_left -= 1
                        self.launch(group, lighthouse)
                time.sleep(0.05)
        finally:
            for group in self.groups:
                if group.process is not None:
                    kill_tree(group.process.pid)
            if self.lighthouse_process is not None:
                self.lighthouse_process.terminate()
                self.lighthouse_process.wait()
            (self.dump / "launcher_events.json").write_text(json.dumps(self.events, indent=1) + "\n")
            steps = {g.index: g.step_times for g in self.groups}
            (self.dump / "launcher_steps.json").write_text(json.dumps(steps) + "\n")
        failed = [g.index for g in self.groups if g.exit_codes[-1:] != [0]]
        return 1 if failed else 0


def group_args(groups: int, index: int, lighthouse: str) -> list[str]:
    return ["--fault_tolerance.enable", "--fault_tolerance.group_size", str(groups), "--fault_tolerance.replica_id",
            str(index), "--fault_tolerance.lighthouse", lighthouse]


def job_folder(args: argparse.Namespace, train_args: list[str]) -> Path:
    """The job's dump folder: ``-- --job.dump_folder``, else ``--dump-folder``, else the TOML's ``[job] dump_folder``
    (the two on the command line must agree); the config is checked here first, as every group's train.py will."""
    from titan_simple.config import load_job_config  # noqa: PLC0415 -- only the config, not the trainer
    from titan_simple.errors import UserError  # noqa: PLC0415

    try:
        config = load_job_config([*train_args, *group_args(args.groups, 0, "http://127.0.0.1:1")])
    except UserError as error:
        raise UsageError(str(error)) from None
    on_command_line = config.sources.get("job.dump_folder") == "command line"
    if args.dump_folder and on_command_line and Path(args.dump_folder).resolve() != Path(
            config.job.dump_folder).resolve():
        raise UsageError(f"--dump-folder {args.dump_folder} and -- --job.dump_folder {config.job.dump_folder} differ; "
                         "give one of them.")
    return Path(args.dump_folder or config.job.dump_folder).resolve()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, not argparse's usage block
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups ([fault_tolerance] group_size)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per group (torchrun --nproc_per_node)")
    parser.add_argument("--dump-folder", default="",
                        help="the job's [job] dump_folder (default: the config's, as train.py would use it)")
    parser.add_argument("--restart", type=int, default=0, help="relaunch a dead group up to this many times")
    parser.add_argument("--kill", action="append", default=[], metavar="G:STEP:WHEN",
                        help="rehearse a failure of group G at STEP (between | allreduce); repeatable")
    parser.add_argument("--hold", action="append", default=[], metavar="G:STEP",
                        help="from STEP on, group G steps only with every group live (so that a restarted group "
                             "rejoins before a short rehearsal ends)")
    parser.add_argument("--lighthouse", default="", help="use this running lighthouse instead of starting one")
    parser.add_argument("--lighthouse-port", type=int, default=0, help="port of the lighthouse started (0: free)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="groups the lighthouse needs for a quorum (the job's first quorum waits for them)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000,
                        help="how long a quorum waits for heartbeating groups that have not asked to join yet")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="silence after which the lighthouse counts a group as dead")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])  # argparse's own errors exit 2 with its usage line
    for name, least in (("groups", 1), ("nproc", 1), ("restart", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name} {getattr(args, name)}: expected at least {least}")
    return args, argv[split + 1:]


def main(argv: list[str]) -> int:
    arguments, train_arguments = parse_args(argv)
    try:
        return Launcher(arguments, train_arguments).run()
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
