"""The live half of scripts/check-ops: a real Prometheus scrapes a running handoff cluster, and
every query of the Grafana dashboard must return data; the alert rules must load and evaluate.

    python3 ops_check.py --bin target/debug/handoff --work TMPDIR \
        --dashboard ops/grafana/handoff-dashboard.json --rules ops/prometheus/alerts.yml \
        [--prefill URL --decode URL --model NAME]

On loopback only: a prefill engine and a decode engine (tcp transport, pull, KV digest on) —
the reference engine's, started here, or, with --prefill and --decode, engines already running
(vLLM with HandoffConnector and `handoff_vllm.HandoffOps`, serving --model) — a
`handoff proxy` in front, and `prometheus` (its own config and TSDB under TMPDIR) scraping the
three every second with the rules loaded. A bounded load goes through the proxy (plain, n=2 and
streamed completions) in two bursts, one before Prometheus starts (so that its first scrape has
every series the load makes) and one after, and each burst injects two faults so that the
series that exist only after an event exist and grow: D is sent a request whose params name a
P that nobody runs, at a port nobody listens on (D's dial is refused and the request's transfer
fails at once: handoff_requests_failed_total{reason}), and P's side channel is sent bytes that
are not a handshake (handoff_side_connections_refused_total{reason}). No panel uses
`or vector(0)`: a panel returns data because the cluster produced it. (A panel reads the
reference engine's `engine_*` series `or` vLLM's own `vllm:*` ones: each returns data from
either kind of engine.)

Then, against Prometheus' HTTP API:
- every target of every panel (`$__rate_interval` replaced by 1m, Grafana's value for this
  scrape interval) returns at least one series with a finite value; a failure names the panel;
- a negative control: a panel's expression with its metric name misspelled returns nothing
  (else "returns data" proves nothing);
- every rule group of the rules file is loaded and every rule evaluates with health "ok";
- the alerts for the injected faults go pending (HandoffTransferFailing,
  HandoffSideChannelRefused), and the alerts of a healthy cluster (stranded blocks, full pool,
  refused handshakes, ...) are not active.

Every process it starts is killed when it ends (also on SIGTERM from `timeout`); each one's pid
is also written to TMPDIR/pids for the calling script's trap. Standard library only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

RATE_INTERVAL = "1m"
procs: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"check-ops: {msg}", file=sys.stderr, flush=True)


class CheckFailed(Exception):
    pass


def _die_with_parent() -> None:
    # Linux: the child gets SIGKILL if this process dies, whatever kills it.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def start(name: str, argv: list[str], work: Path) -> tuple[subprocess.Popen, Path, Path]:
    out = work / f"{name}.out"
    err = work / f"{name}.err"
    env = dict(os.environ, NO_COLOR="1", RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    p = subprocess.Popen(argv, stdout=out.open("wb"), stderr=err.open("wb"),
                         stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
    procs.append(p)
    with (work / "pids").open("a") as f:
        f.write(f"{p.pid}\n")
    return p, out, err


def stop_all() -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5
    for p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def first_line_url(p: subprocess.Popen, out: Path, err: Path, what: str, secs: float = 20) -> str:
    """The URL of the `... listening on http://HOST:PORT` line the process prints first."""
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        text = out.read_text(errors="replace") if out.exists() else ""
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
        if m:
            return m.group(1)
        if p.poll() is not None:
            raise CheckFailed(f"{what} exited ({p.returncode}) before listening:\n{tail(err)}")
        time.sleep(0.05)
    raise CheckFailed(f"{what} printed no `listening on` line in {secs}s:\n{tail(err)}")


# Straight to loopback, whatever http_proxy says.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    assert url.startswith("http://127.0.0.1:"), url  # loopback only
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json"} if data else {})
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get_json(url: str, timeout: float = 10) -> dict:
    status, body = http("GET", url, timeout=timeout)
    if status != 200:
        raise CheckFailed(f"GET {url}: {status} {body[:300]!r}")
    return json.loads(body)


def wait_until(what: str, secs: float, probe) -> object:
    deadline = time.monotonic() + secs
    last = None
    while time.monotonic() < deadline:
        try:
            v = probe()
            if v:
                return v
        except (OSError, CheckFailed, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise CheckFailed(f"timed out after {secs}s waiting for {what}" + (f" (last: {last})" if last else ""))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# --- the dashboard ------------------------------------------------------------------------------

def dashboard_queries(path: Path) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every target of every panel, rows' nested panels too."""
    dash = json.loads(path.read_text())
    out = []
    ids = set()

    def walk(panels):
        for p in panels:
            if p.get("id") in ids:
                raise CheckFailed(f"{path}: panel id {p.get('id')} used twice")
            ids.add(p.get("id"))
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            title = p.get("title", f"id {p.get('id')}")
            targets = p.get("targets") or []
            if not targets:
                raise CheckFailed(f"{path}: panel {title!r} has no query")
            for t in targets:
                expr = t.get("expr", "")
                if not expr.strip():
                    raise CheckFailed(f"{path}: panel {title!r} target {t.get('refId')} has no expr")
                ds = (t.get("datasource") or p.get("datasource") or {})
                if ds.get("type") != "prometheus":
                    raise CheckFailed(f"{path}: panel {title!r} does not query Prometheus")
                out.append((title, t.get("refId", "?"), expr))

    if dash.get("schemaVersion", 0) < 36:
        raise CheckFailed(f"{path}: schemaVersion {dash.get('schemaVersion')} (want a current one)")
    names = {v.get("name") for v in dash.get("templating", {}).get("list", [])}
    walk(dash.get("panels", []))
    for title, ref, expr in out:
        # Variables Prometheus cannot evaluate: only $__rate_interval is replaced here. (`$1`
        # is label_replace's capture group: Grafana leaves a name no variable has alone.)
        for var in re.findall(r"\$\{?([A-Za-z_]\w*)", expr):
            if var != "__rate_interval":
                raise CheckFailed(f"panel {title!r} target {ref}: expr uses ${var}, which only "
                                  f"Grafana knows (templating: {sorted(n for n in names if n)})")
    return out


def promql(expr: str) -> str:
    return expr.replace("${__rate_interval}", RATE_INTERVAL).replace("$__rate_interval", RATE_INTERVAL)


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, body = http("GET", url, timeout=10)
    doc = json.loads(body)
    if status != 200 or doc.get("status") != "success":
        raise CheckFailed(f"query refused ({status}): {doc.get('error', body[:300])}\n  {expr}")
    data = doc["data"]
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def finite(result: list[dict]) -> list[dict]:
    return [r for r in result if "value" in r and math.isfinite(float(r["value"][1]))]


# --- the cluster and its load -------------------------------------------------------------------

def completion(url: str, body: dict) -> dict:
    status, raw = http("POST", f"{url}/v1/completions", body, timeout=30)
    if status != 200:
        raise CheckFailed(f"POST {url}/v1/completions -> {status}: {raw[:300]!r}")
    if body.get("stream"):
        if b"data:" not in raw:
            raise CheckFailed(f"streamed completion without events: {raw[:200]!r}")
        return {}
    return json.loads(raw)


def load(proxy: str, model: str, n: int) -> int:
    words = ("the prefill engine computes a prompt and the decode engine reads its blocks "
             "over the transport while the lease holds").split()
    bodies = []
    for i in range(n):
        prompt = " ".join(words[j % len(words)] for j in range(i, i + 6 + (i * 37) % 180))
        body = {"model": model, "prompt": prompt, "max_tokens": 8}
        if i % 4 == 1:
            body["n"] = 2
        if i % 6 == 5:
            body["stream"] = True
        bodies.append(body)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        for body, answer in zip(bodies, ex.map(lambda b: completion(proxy, b), bodies)):
            want = body.get("n", 1)
            if not body.get("stream") and len(answer.get("choices", [])) != want:
                raise CheckFailed(f"the proxy answered {answer!r} to n={want}")
    return n


HANDOFF_PROMPT = "the prefill engine hands this prompt's blocks to the decode engine"


def one_handoff(prefill: str, decode: str, model: str) -> dict:
    """One request P prefills for a remote D and D decodes from P's KV (what the proxy does):
    P's kv_transfer_params, whose shape the faults copy (P's handoff is consumed, nothing is
    left to expire)."""
    first = completion(prefill, {"model": model, "prompt": HANDOFF_PROMPT, "max_tokens": 1,
                                 "kv_transfer_params": {"do_remote_decode": True}})
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("remote_port"):
        raise CheckFailed(f"P answered no kv_transfer_params: {first!r}")
    completion(decode, {"model": model, "prompt": HANDOFF_PROMPT, "max_tokens": 2,
                        "kv_transfer_params": params})
    return params


def transfer_fault(decode: str, model: str, p_params: dict, i: int) -> None:
    """A D request whose kv_transfer_params name a P nobody runs, at a loopback port nobody
    listens on: D's dial is refused and the request's transfer fails at once
    (handoff_requests_failed_total{reason}); D recomputes or fails the request, as its policy
    says, so its answer is not checked."""
    # Bound and never listening until D's answer: Linux refuses connections to it, and nothing
    # else can take the port meanwhile.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        params = dict(p_params, remote_engine_id=f"ops-check-nobody-{i}",
                      remote_host="127.0.0.1", remote_port=s.getsockname()[1],
                      handoff_id=f"{0xdead0000 + i:032x}")
        http("POST", f"{decode}/v1/completions",
             {"model": model, "prompt": HANDOFF_PROMPT, "max_tokens": 2,
              "kv_transfer_params": params})


def side_channel_fault(p_params: dict) -> None:
    """Bytes that are not a handshake on P's side channel: P closes the connection before its
    first frame (handoff_side_connections_refused_total{reason})."""
    host, port = p_params["remote_host"], p_params["remote_port"]
    if host != "127.0.0.1":
        raise CheckFailed(f"P's side channel is at {host}, not on loopback: this check stays there")
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 8)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass


def burst(proxy: str, decode: str, model: str, p_params: dict, n: int, i: int) -> int:
    """n completions through the proxy, with one injected transfer failure and one
    side-channel refusal at the same time."""
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        sent = ex.submit(load, proxy, model, n)
        failed = ex.submit(transfer_fault, decode, model, p_params, i)
        refused = ex.submit(side_channel_fault, p_params)
        refused.result()
        failed.result()
        return sent.result()


# --- main ---------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--rules", required=True)
    ap.add_argument("--prometheus", default="prometheus")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prefill", help="a running P's URL (with --decode): check it, start none")
    ap.add_argument("--decode", help="a running D's URL (with --prefill)")
    ap.add_argument("--model", default="handoff-synthetic-8b", help="the model the engines serve")
    args = ap.parse_args()
    if bool(args.prefill) != bool(args.decode):
        ap.error("--prefill and --decode go together")
    work = Path(args.work).resolve()
    rules_file = Path(args.rules).resolve()

    queries = dashboard_queries(Path(args.dashboard))
    panels = sorted({q[0] for q in queries})
    rules_text = rules_file.read_text()
    want_groups = re.findall(r"^\s*- name:\s*(\S+)", rules_text, re.M)
    want_rules = re.findall(r"^\s*- alert:\s*(\S+)", rules_text, re.M)

    t0 = time.monotonic()
    # The cluster: P and D with the KV digest on (so its panel has data).
    engines: list[tuple[subprocess.Popen, str]] = []
    if args.prefill:
        prefill, decode = args.prefill.rstrip("/"), args.decode.rstrip("/")
        for url in (prefill, decode):
            status, _ = http("GET", f"{url}/health", timeout=5)  # loopback only
            if status != 200:
                raise CheckFailed(f"GET {url}/health answered {status}")
    else:
        common = ["--host", "127.0.0.1", "--port", "0", "--transport", "tcp", "--mode", "pull",
                  "--set", "kv_digest=true"]
        p, p_out, p_err = start("prefill", [args.bin, "engine", "--role", "prefill",
                                            "--engine-id", "ops-p0", *common], work)
        d, d_out, d_err = start("decode", [args.bin, "engine", "--role", "decode",
                                           "--engine-id", "ops-d0", *common], work)
        prefill = first_line_url(p, p_out, p_err, "the prefill engine")
        decode = first_line_url(d, d_out, d_err, "the decode engine")
        engines = [(p, "prefill engine"), (d, "decode engine")]
    x, x_out, x_err = start("proxy", [args.bin, "proxy", "--bind", "127.0.0.1:0",
                                      "--admin-listen", "off", "--health-interval-ms", "200",
                                      "--prefill", prefill, "--decode", decode], work)
    proxy = first_line_url(x, x_out, x_err, "the proxy")
    wait_until("the proxy's /ready", 20, lambda: http("GET", f"{proxy}/ready", timeout=2)[0] == 200)
    p_params = one_handoff(prefill, decode, args.model)
    log(f"cluster up: P {prefill}, D {decode}, proxy {proxy}")

    # A first burst before Prometheus starts, so that its first scrape already has every series
    # the load makes (those of n=2 and streamed requests, of a failed transfer and a refusal).
    warm = burst(proxy, decode, args.model, p_params, 6, 0)

    # Prometheus: scrapes the three every second, evaluates the rules every second.
    targets = {"handoff-engine": [prefill, decode], "handoff-proxy": [proxy]}
    cfg = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s", "  evaluation_interval: 1s",
           "rule_files:", f"  - {json.dumps(str(rules_file))}", "scrape_configs:"]
    for job, urls in targets.items():
        cfg += [f"  - job_name: {job}", "    static_configs:", "      - targets:"]
        cfg += [f"          - 127.0.0.1:{port_of(u)}" for u in urls]
    (work / "prometheus.yml").write_text("\n".join(cfg) + "\n")
    prom = None
    for attempt in range(3):
        port = free_port()
        pr, pr_out, pr_err = start(f"prometheus{attempt}", [
            args.prometheus, f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / f'tsdb{attempt}'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], work)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pr.poll() is None:
            try:
                if http("GET", f"{url}/-/ready", timeout=2)[0] == 200:
                    prom = url
                    break
            except OSError:
                pass
            time.sleep(0.2)
        if prom:
            break
        log(f"prometheus did not start on port {port}:\n{tail(pr_err)}")
        if pr.poll() is None:
            pr.kill()
    if not prom:
        raise CheckFailed("prometheus did not start")
    build = get_json(f"{prom}/api/v1/status/buildinfo")["data"]
    version = build.get("version", "?").split("+")[0]

    def all_up():
        active = get_json(f"{prom}/api/v1/targets")["data"]["activeTargets"]
        return len(active) == 3 and all(t["health"] == "up" for t in active)
    wait_until("all three targets up in Prometheus", 30, all_up)
    log(f"prometheus {version} at {prom}: 3 targets up")

    # Until Prometheus has scraped the load so far.
    def scraped(ok_n: int, faults_n: int) -> bool:
        ok = finite(query(prom, 'sum(handoff_proxy_requests_total{outcome="ok"})'))
        failed = finite(query(prom, "sum(handoff_requests_failed_total)"))
        refused = finite(query(prom, "sum(handoff_side_connections_refused_total)"))
        return bool(ok and float(ok[0]["value"][1]) >= ok_n
                    and failed and float(failed[0]["value"][1]) >= faults_n
                    and refused and float(refused[0]["value"][1]) >= faults_n)
    wait_until("Prometheus to scrape the first burst", 20, lambda: scraped(warm, 1))

    # The load, with the faults a second time: every series Prometheus saw after the first
    # burst increases (rate() needs two samples: a series' first one is no increase), however
    # many scrapes a busy machine misses meanwhile.
    sent = warm + burst(proxy, decode, args.model, p_params, args.requests, 1)
    log(f"load: {sent} completions through the proxy, 2 failed transfers and 2 side-channel refusals injected")
    wait_until("Prometheus to scrape the load", 20, lambda: scraped(sent, 2))
    time.sleep(2.5)  # two more scrapes and rule evaluations

    # Every query of every panel (HANDOFF_OPS_VERBOSE=1 prints what each returned).
    verbose = os.environ.get("HANDOFF_OPS_VERBOSE") == "1"
    failures = []
    nonzero = 0
    for title, ref, expr in queries:
        try:
            res = query(prom, promql(expr))
        except CheckFailed as e:
            failures.append(f"panel {title!r} target {ref}: {e}")
            continue
        if verbose:
            shown = ", ".join(f"{ {k: v for k, v in r['metric'].items() if k != '__name__'} }="
                              f"{float(r['value'][1]):.4g}" for r in res[:4])
            log(f"  {title} [{ref}]: {len(res)} series: {shown}")
        if not res:
            failures.append(f"panel {title!r} target {ref}: no data\n    {expr}")
        elif not finite(res):
            failures.append(f"panel {title!r} target {ref}: only NaN/Inf\n    {expr}")
        elif any(float(r["value"][1]) != 0 for r in finite(res)):
            nonzero += 1
    if failures:
        state = [f"{t['scrapeUrl']}: {t['health']} (last scrape {t['lastScrapeDuration']:.3f}s"
                 f"{', ' + t['lastError'] if t['lastError'] else ''})"
                 for t in get_json(f"{prom}/api/v1/targets")["data"]["activeTargets"]]
        raise CheckFailed(f"{len(failures)} of {len(queries)} dashboard queries returned no data "
                          f"from Prometheus {version}:\n  " + "\n  ".join(failures)
                          + "\n  targets: " + "; ".join(state))

    # The negative control: the same check on a misspelled metric must find nothing.
    title, ref, expr = queries[0]
    broken = re.sub(r"\bhandoff_", "handoff_misspelled_", promql(expr), count=1)
    if broken == promql(expr):
        raise CheckFailed(f"negative control: cannot misspell a metric in {expr!r}")
    for control in (broken, "handoff_kv_blocks_helt"):
        if query(prom, control):
            raise CheckFailed(f"negative control returned data: {control!r}: the check has no power")

    # The alert rules: loaded, every group and rule present, each evaluated with health "ok".
    def evaluated():
        groups = get_json(f"{prom}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        # Not evaluated yet: lastEvaluation is Go's zero time.
        done = all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules)
        return groups if rules and done else None
    groups = wait_until("every rule evaluated", 15, evaluated)
    got_groups = [g["name"] for g in groups]
    got_rules = [r["name"] for g in groups for r in g["rules"]]
    if sorted(got_groups) != sorted(want_groups) or sorted(got_rules) != sorted(want_rules):
        raise CheckFailed(f"Prometheus loaded groups {got_groups} rules {got_rules}; the file has "
                          f"{want_groups} {want_rules}")
    bad = [f"{r['name']}: {r.get('health')} {r.get('lastError', '')}" for g in groups
           for r in g["rules"] if r.get("health") != "ok"]
    if bad:
        raise CheckFailed("rules that do not evaluate:\n  " + "\n  ".join(bad))

    # The alerts the injected faults raise (pending: each has a `for`), and none of a healthy
    # cluster's.
    expected = {"HandoffTransferFailing", "HandoffSideChannelRefused"}
    healthy = {"HandoffBlocksStranded", "HandoffLeaseAgeTailHigh", "HandoffHandoffsExpiring",
               "HandoffKVDigestMismatch", "HandoffHandshakesRefused", "HandoffTransportRefused",
               "HandoffEnginePoolFull", "HandoffProxyInstanceUnhealthy"}
    missing = (expected | healthy) - set(want_rules)
    if missing:
        raise CheckFailed(f"the rules file has no alert {sorted(missing)}")

    def active():
        alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
        names = {a["labels"]["alertname"] for a in alerts if a["state"] in ("pending", "firing")}
        return (names, alerts) if expected <= names else None
    try:
        names, alerts = wait_until("the injected faults' alerts to go pending", 15, active)
    except CheckFailed:
        alerts = get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]
        raise CheckFailed(f"alerts {sorted(expected)} not pending on the injected faults; "
                          f"active: {[(a['labels'], a['state']) for a in alerts]}")
    wrong = sorted(names & healthy)
    if wrong:
        raise CheckFailed(f"alerts active on a healthy cluster: {wrong}: "
                          f"{[a for a in alerts if a['labels']['alertname'] in wrong]}")
    pending = sorted(f"{a['labels']['alertname']}{{reason={a['labels'].get('reason')}}}"
                     for a in alerts if a["labels"]["alertname"] in expected)

    for proc, name in (*engines, (x, "proxy")):
        if proc.poll() is not None:
            raise CheckFailed(f"the {name} exited ({proc.returncode}) during the check")

    log(f"{len(queries)} queries of {len(panels)} panels returned data ({nonzero} non-zero); "
        f"negative control empty; {len(got_rules)} rules in {len(got_groups)} groups evaluate ok; "
        f"pending on the injected faults: {', '.join(pending)} ({time.monotonic() - t0:.0f}s)")
    print(json.dumps({"prometheus": version, "panels": len(panels), "queries": len(queries),
                      "rules": len(got_rules), "groups": len(got_groups),
                      "engines": "running" if args.prefill else "reference",
                      "pending": pending}))
    return 0


def _on_term(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    code = 1
    try:
        code = main()
    except CheckFailed as e:
        log(f"FAILED: {e}")
        work = Path(sys.argv[sys.argv.index("--work") + 1]) if "--work" in sys.argv else None
        if work:
            for f in sorted(work.glob("*.err")):
                t = tail(f, 8)
                if t.strip():
                    log(f"--- last lines of {f.name}:\n{t}")
    finally:
        stop_all()
    sys.exit(code)
