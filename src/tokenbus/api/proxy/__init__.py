"""`tokenbus proxy`: the disaggregated prefill/decode router (L5).

One HTTP front door for two pools of ordinary tokenbus servers. Each completion runs on a
prefill instance first (one token, `kv_transfer_params: {"do_remote_decode": true}`), then on a
decode instance that gets the prefiller's `kv_transfer_params` and streams the answer back.

    config.py  ProxyConfig: upstream URLs, host/port, timeouts
    pool.py    instances of one kind: health, in-flight counts, least-loaded choice
    health.py  the background probe (GET URL/health; a one-token completion for an instance
               that let a leg time out) that takes instances out and back in
    router.py  one request's two legs, their timeouts, retries on dead or hung instances,
               the fallbacks
    metrics.py Prometheus counters and gauges per instance
    errors.py  the OpenAI error shape for what the proxy answers itself
    app.py     routes, the upstream HTTP client's life cycle, run_proxy

It imports neither torch nor the engine (a contract in pyproject.toml): it runs anywhere.
"""
