"""Two ways of running the trainer in the fullscale tests without a fresh interpreter's
imports per run.

`main_here(argv)`: `python -m fullscale.train ARGV` in the test's process, for the runs a
case needs only as its setup or its continuation (not as a process that is killed,
signalled, traced or exits).

`LAUNCHER`: a fork server of trainer processes (test_crash.py, test_faults_part2.py),
run as `python -c LAUNCHER`: it imports the trainer once, then per stdin line (a JSON list of
{argv, env, log}) forks one process per entry, prints their pids, and once all have ended
(one that fails has the others killed, as a rank's death ends a job) their exit codes. A
kill then costs the model build, not torch's imports."""

import subprocess
import warnings

import torch

# what Python's default warning filters hide in a process (outside __main__)
HIDDEN_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def main_here(argv: list[str], capsys=None) -> subprocess.CompletedProcess:
    """fullscale.train.main(argv) in this process: its exit status, and its stderr where
    `capsys` is given, with the warnings a process would have printed there (each once, as
    Python's default filter shows them). One torch thread, as the subprocesses
    (OMP_NUM_THREADS 1): the runs of either kind are bitwise the same."""
    from fullscale.train import main

    if capsys is not None:
        capsys.readouterr()
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            rc = main(argv)
    finally:
        torch.set_num_threads(n)
    stdout, stderr = capsys.readouterr() if capsys is not None else ("", "")
    stderr += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)
                      for w in caught if not issubclass(w.category, HIDDEN_BY_DEFAULT))
    return subprocess.CompletedProcess(argv, rc, stdout, stderr)

LAUNCHER = r"""
import json, os, signal, sys, time
import torch.multiprocessing as mp
import fullscale.train   # imported once here; every forked trainer reuses it
import torch._dynamo     # so is this: the trainer's meta-device model build imports it (~1.5 s)

def child(argv, env, log):
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(fullscale.train.main(argv))

ctx = mp.get_context("fork")
for line in sys.stdin:
    req = json.loads(line)
    procs = [ctx.Process(target=child, args=(p["argv"], p["env"], p["log"])) for p in req]
    for p in procs:
        p.start()
    print(json.dumps([p.pid for p in procs]), flush=True)
    while any(p.is_alive() for p in procs):     # one rank dies: the others are killed
        if any(p.exitcode not in (None, 0) for p in procs):
            for q in procs:
                if q.is_alive():
                    os.kill(q.pid, signal.SIGKILL)
        time.sleep(0.005)
    print(json.dumps([p.exitcode for p in procs]), flush=True)
"""
