#!/bin/bash
# prefix-router microbench --sizes 2,32 --json, alternating the old tree (5118111) and the working tree
cd /tmp  # PYTHONPATH picks the tree: a git worktree of 5118111 at /tmp/wt-http-before, or /work/main
MB='import sys; from extproc.cli import main; sys.exit(main(["microbench", "--sizes", "2,32", "--json"]))'
for i in $(seq 1 ${1:-6}); do
  PYTHONPATH=/tmp/wt-http-before:/tmp/wt-http-before/lab /work/main/.venv/bin/python -c "$MB" > mbj-before-$i.json
  PYTHONPATH=/work/main:/work/main/lab /work/main/.venv/bin/python -c "$MB" > mbj-after-$i.json
  echo "pair $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
