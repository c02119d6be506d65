#!/bin/bash
# the overhead rig on envoy-fast.yaml at 32 KB, alternating the old tree (5118111) and the new one
cd /tmp
for i in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then PP=/tmp/wt-http-before:/tmp/wt-http-before/lab; else PP=/work/main:/work/main/lab; fi
    echo "== $tree $i $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    PYTHONPATH=$PP /work/main/.venv/bin/python -c 'import sys; from extproc.cli import main; sys.exit(main(sys.argv[1:]))' \
      bench --scenario overhead --param configs=envoy-fast.yaml --param sizes=32 --param rounds=2 \
      --param connections=16 --out oh-$tree-$i > oh-$tree-$i.log 2>&1
    echo "rc=$?"
  done
done
