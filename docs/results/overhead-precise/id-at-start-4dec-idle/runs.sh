#!/bin/bash
# id_at=start (every 32 KB prompt new): before = a worktree of 94eda44 (run from its own directory so
# `python -m extproc` imports it), after = /work/main; alternated twice. Run three times on 4 Dec 2026 with
# the word cache's long-text path as it stood: 1f19b8e (in parts on the loop, no other bound: out dir
# id-at-start-4dec, 17:19-17:26 UTC), 6e5d64c (one long text at a time: id-at-start-4dec-one, 17:28-17:34),
# bed0476 (only while no other long text is being tokenised: id-at-start-4dec-idle, 17:35-17:41).
for i in 1 2; do
  for which in before after; do
    if [ $which = before ]; then cd /tmp/s/wt-before; export PYTHONPATH=/tmp/s/wt-before/lab; else cd /work/main; unset PYTHONPATH; fi
    /work/main/.venv/bin/python -m extproc bench --scenario overhead --param configs=pick.yaml,pick.yaml+events --param sizes=32 \
      --param rounds=2 --param connections=1,16 --param id_at=start --out /work/main/docs/results/overhead-precise/id-at-start-4dec-idle/$which-$i > /tmp/s/start-$which-$i.log 2>&1
    echo "$which-$i rc=$? $(date +%T)"
  done
done
