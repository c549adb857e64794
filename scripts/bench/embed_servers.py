"""/v1/embeddings throughput of two servers on the same GGUF, alternated: 32 texts of 128 words
(each one token of the checkpoint's vocabulary) per request, and one short text's latency."""
import json, random, statistics, sys, time, urllib.request
urls = {"pagedllm": sys.argv[1], "llama.cpp": sys.argv[2]}
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
rng = random.Random(0)
MODEL = sys.argv[4] if len(sys.argv) > 4 else "/work/files/bert-base-random-f16.gguf"  # the served model name
def texts(n, words): return [" ".join(f"w{rng.randrange(30000)}" for _ in range(words)) for _ in range(n)]
def post(url, inputs):
    body = json.dumps({"model": MODEL, "input": inputs}).encode()
    req = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    dt = time.perf_counter() - t
    assert len(out["data"]) == len(inputs) and len(out["data"][0]["embedding"]) == 768, out.keys()
    return dt
for url in urls.values(): post(url, texts(32, 128)); post(url, texts(1, 8))  # warm-up
res = {k: [] for k in urls}; lat = {k: [] for k in urls}
for r in range(rounds):
    batch = texts(32, 128); short = texts(5, 8)
    for name, url in urls.items():
        res[name].append(32 / post(url, batch))
        lat[name].append(statistics.median(post(url, [s]) * 1e3 for s in short))
        print(f"round {r} {name}: {res[name][-1]:.1f} texts/s, short p50 {lat[name][-1]:.1f} ms", flush=True)
a, b = (statistics.median(res[k]) for k in urls)
la, lb = (statistics.median(lat[k]) for k in urls)
print(f"median texts/s pagedllm {a:.1f} llama.cpp {b:.1f}: {a/b:.2f}x; short p50 {la:.1f} / {lb:.1f} ms")
