"""soak_serve.py's fairness mix: the load under which a short request once starved, and whether
anything waits longer than first-come-first-served allows.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/soak_serve.py --fair 60 --embedded \
        --batch_invariant --max_num_seqs 64 --num_blocks 2048

For `seconds`, 64 client threads (each a closed loop) send: streamed chats of 200 tokens, a quarter
with n = 2, read to the end (35%); streamed completions of 200 tokens the client drops after five
events (20%); plain chats of 30 tokens (45%). Every 5 s a probe sends the short greedy completion
that once timed out ("a short one", 24 tokens, not streamed). Then the clients stop, the server
drains, and the report says:
- each probe's latency and whether its text is its alone-run's (the engine run alone afterwards);
- time in the queue (arrival to first step) from the engine's own record of every request, p50,
  p99 and max, against what FCFS predicts: the same arrivals, each holding n slots for the time it
  measurably ran, admitted strictly in arrival order into --max_num_seqs slots; the goal is p99 no
  worse than twice the prediction (the scheduler's fair share, which takes a slot from a request
  holding more than its share for one holding none, can only do better than strict FCFS);
- admissions out of arrival order (a request first run while an earlier arrival still waited), and
  steps after which a request waited, older than every running one, while slots were free;
- 5xx replies, blocks and requests left once idle.
"""

import random
import threading
import time

import httpx

from batch import percentile

PROBE = {"prompt": "a short one", "max_tokens": 24, "temperature": 0}


def traced(engine):
    """Wrap engine.step: every finished request kept (arrival, first step, end, n), each step's
    time, and the steps after which slots were free while an old request waited."""
    trace = dict(finished=[], steps=[], idle_slots_waits=0)
    step, limit = engine.step, engine.scheduler.max_num_seqs

    def traced_step():
        start = time.perf_counter()
        events = step()
        now = time.perf_counter()
        trace["steps"].append(now - start)
        for e in events:
            if hasattr(e, "result"):  # engine.Finished
                r = e.request
                trace["finished"].append((r.arrival, r.admitted, now, r.params.n))
        s = engine.scheduler
        running = [q.request.arrival for q in s.running]
        waiting = [q.request.arrival for q in s.waiting if q.request.admitted is None]
        if waiting and running and len(running) < limit and min(waiting) < min(running):
            trace["idle_slots_waits"] += 1
        return events

    engine.step = traced_step
    return trace


def fcfs_waits(finished, slots: int) -> list:
    """Queue times FCFS predicts for these requests: arrival order, n slots each, each held for
    as long as the request measurably ran."""
    free_at = [0.0] * slots  # when each slot frees
    waits = []
    for arrival, admitted, end, n in sorted(finished):
        if admitted is None:  # aborted before it ran: it held no slot
            continue
        free_at.sort()
        start = max(arrival, free_at[min(n, slots) - 1])
        for k in range(min(n, slots)):
            free_at[k] = start + (end - admitted)
        waits.append(start - arrival)
    return waits


def out_of_order(finished) -> int:
    """Requests first run while one that arrived before them still waited."""
    ran = sorted((a, s) for a, s, _, _ in finished if s is not None)
    latest, count = 0.0, 0
    for _, started in ran:  # by arrival: a start earlier than an earlier arrival's is a jump
        count += started < latest
        latest = max(latest, started)
    return count


def client(url, headers, rng, deadline, statuses):
    """One closed-loop client of the mix until the deadline."""
    with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
        while time.time() < deadline:
            kind, words = rng.random(), " ".join(["story"] * rng.randint(1, 30))
            if kind < 0.55:
                body = {"max_tokens": 200, "stream": True, "ignore_eos": True}
                if kind < 0.35:
                    body |= {"messages": [{"role": "user", "content": words}], "n": 1}
                    body["n"] = 2 if rng.random() < 0.25 else 1
                    path, drop = "/v1/chat/completions", None
                else:
                    body, path, drop = body | {"prompt": words}, "/v1/completions", 10
                with http.stream("POST", path, json=body) as r:
                    for i, _ in enumerate(r.iter_lines()):
                        if drop and i == drop:  # five events: data lines and their blank lines
                            break
                    statuses.append(r.status_code)
            else:
                body = {"messages": [{"role": "user", "content": words}], "max_tokens": 30}
                statuses.append(http.post("/v1/chat/completions", json=body).status_code)


def probe(url, headers, every: float, deadline, probes):
    """The short greedy completion every `every` seconds until the deadline: (latency, status,
    text)."""
    with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
        while time.time() + every < deadline:
            time.sleep(every)
            start = time.perf_counter()
            r = http.post("/v1/completions", json=PROBE)
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
            probes.append((time.perf_counter() - start, r.status_code, text))


def fair_soak(engine, tokenizer, seconds: float, start_server, key, clients=64, seed=0) -> dict:
    """The mix against a fresh server on `engine` (start_server: soak_serve's); the report."""
    from engine import RequestParams
    from server.server_limits import Limits

    trace = traced(engine)
    url, stop = start_server(engine, tokenizer, Limits(max_waiting=4 * clients))
    headers, statuses, probes = {"Authorization": f"Bearer {key}"}, [], []
    deadline = time.time() + seconds
    threads = [
        threading.Thread(
            target=client, args=(url, headers, random.Random(seed + i), deadline, statuses)
        )
        for i in range(clients)
    ]
    threads.append(threading.Thread(target=probe, args=(url, headers, 5.0, deadline, probes)))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.time() + 60
        while (engine.requests or engine.scheduler.blocks_used()) and time.time() < end:
            time.sleep(0.05)
        blocks, left = engine.scheduler.blocks_used(), len(engine.requests)
    finally:
        stop()
    del engine.step  # (the alone-run below is not part of the trace)
    ids = tokenizer.encode(PROBE["prompt"])
    alone = engine.run_batch([ids], RequestParams(max_new_tokens=24, temperature=0))[0]["text"]
    return report(trace, probes, statuses, alone, engine.scheduler.max_num_seqs, blocks, left)


def report(trace, probes, statuses, alone: str, slots: int, blocks: int, left: int) -> dict:
    waits = [s - a for a, s, _, _ in trace["finished"] if s is not None]
    predicted = fcfs_waits(trace["finished"], slots)
    latency, step_s = [p[0] for p in probes], sum(trace["steps"]) / max(1, len(trace["steps"]))
    return {
        "requests": len(trace["finished"]),
        "steps": len(trace["steps"]),
        "step_ms_mean": round(1000 * step_s, 1),
        "probes": len(probes),
        # a probe's own steps (its prefill, 24 tokens) at that step time: its latency unqueued
        "probe_own_steps_s": round((PROBE["max_tokens"] + 1) * step_s, 2),
        "probe_latency_p50_s": round(percentile(latency, 0.5), 2),
        "probe_latency_max_s": round(max(latency, default=float("nan")), 2),
        "probe_texts_unlike_alone": sum(1 for p in probes if p[2] != alone),
        "queue_p50_s": round(percentile(waits, 0.5), 2),
        "queue_p99_s": round(percentile(waits, 0.99), 2),
        "queue_max_s": round(max(waits, default=0.0), 2),
        "fcfs_queue_p50_s": round(percentile(predicted, 0.5), 2),
        "fcfs_queue_p99_s": round(percentile(predicted, 0.99), 2),
        "admitted_out_of_order": out_of_order(trace["finished"]),
        "steps_with_an_old_request_waiting_by_free_slots": trace["idle_slots_waits"],
        "server_errors": sum(1 for s in statuses + [p[1] for p in probes] if s >= 500),
        "blocks_in_use": blocks,
        "requests_left": left,
    }
