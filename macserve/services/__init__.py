"""Services: a profile -> its provider's argv -> a supervised process -> health -> rollback.

    profiles.py     the profile file format and store; `Profile`, typed and parsed once
    plan.py         what `new` serves and how big (from sizing's report)
    the service commands (the CLI, doctor and the router import each from its module):
      health.py       health waits, Outcome, SetFailed; store, base_url
      ports.py        a free port no other profile has
      create.py       new, new_worker, new_router
      edit.py         set: check, save, restart, roll back
      lifecycle.py    start, stop, restart, remove; endpoint
      journal.py      the change journal: changing (a set is at work), recover (a killed one)
      share.py        the memory share: weights + PARALLEL caches + prompt cache + baseline + reserve
      baseline.py     the server process's own bytes, measured once per provider + model
      views.py        the rows behind ls / status / show
    routed.py       what running routers publish for ls (router/ writes it; nothing here
                    imports router/)
    run.py          `macserve run NAME`: exec the profile's server (what a service runs), with
                    its secrets in the environment, back-off and launchd log rotation
    pull.py         download a hub model into the Hugging Face cache (only what it needs)
    doctor.py       do the services that start at login fit the GPU wired limit?
    preflight.py    multi-host checks over ssh before an mlx.launch group starts
    providers/      one module per server kind; each validates its own keys
    supervisors/    the Backend protocol; launchd (macOS) and supervisord (elsewhere); logs

Imports flow down: services -> sizing. Never the engine (its provider runs it as a process).
"""
