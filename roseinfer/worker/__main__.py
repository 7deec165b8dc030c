"""`python -m roseinfer.worker SPEC_JSON`: one tensor-parallel worker process (see worker.py).

Workers are plain subprocesses rather than multiprocessing children, so starting one never
re-imports the user's main module and works from daemonic processes too."""

import sys

from roseinfer.worker.worker import WorkerSpec, run_worker

if __name__ == "__main__":
    run_worker(WorkerSpec.from_json(sys.argv[1]))
