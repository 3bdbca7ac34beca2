"""A fork server of trainer processes (tests/fullscale/test_crash.py, test_faults_part2.py),
run as `python -c LAUNCHER`: it imports the trainer once, then per stdin line (a JSON list of
{argv, env, log}) forks one process per entry, prints their pids, and once all have ended
(one that fails has the others killed, as a rank's death ends a job) their exit codes. A
kill then costs the model build, not torch's imports."""

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
