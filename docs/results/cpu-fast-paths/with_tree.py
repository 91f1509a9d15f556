"""Run a script against another checkout's gspo_ascend: drops the editable install's finder (which maps the package
to /work/main whatever sys.path says) and puts TREE first. Usage: with_tree.py TREE SCRIPT ARGS..."""

import runpy
import sys

tree = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
sys.path.insert(0, tree)
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
