import collections, re, sys
def agg(path):
    total = 0; c = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(' ')
        if not stack: continue
        n = int(n); total += n
        fr = stack.split(';')
        last = fr[-1]
        if 'Process (' in stack and 'ext_proc.py' in stack: k = 'request path (ext_proc Process/prepare, Python)'
        elif 'KvEventSubscriber' in stack: k = 'KV events ingest (Python)'
        elif 'Thread.run' in last: k = 'a thread, native (grpc aio poller)'  # the one such thread py-spy dump shows
        elif 'runners.py:118' in last: k = 'event loop, native (uvloop + grpc aio + zmq)'
        elif 'Scrape' in stack or 'scrape' in stack: k = 'metrics scrape (Python)'
        else: k = 'other Python: ' + last.split(' (')[0]
        c[k] += n
    return total, c
for p in sys.argv[1:]:
    total, c = agg(p)
    print(p, total, "samples")
    for k, n in c.most_common(12): print(f"  {n/total*100:5.1f}%  {k}")
