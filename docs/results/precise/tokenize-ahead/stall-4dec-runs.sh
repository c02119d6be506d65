#!/bin/bash
# stall bench, before (a worktree of 94eda44 at /tmp/s/wt-before) and after (/work/main at cd8f682, the code of
# bed0476), alternated twice, the defaults and --long-every 0.005
for i in 1 2; do
  for which in before after; do
    if [ $which = before ]; then cd /tmp/s/wt-before; export PYTHONPATH=/tmp/s/wt-before:/tmp/s/wt-before/lab; else cd /work/main; export PYTHONPATH=/work/main:/work/main/lab; fi
    for args in "" "--long-every 0.005"; do
      echo "== $which-$i $args"
      /work/main/.venv/bin/python -m routerlab.bench.stall $args 2>&1 | tail -6
    done
  done
done
