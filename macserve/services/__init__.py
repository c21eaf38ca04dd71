"""Services: a profile -> its provider's argv -> a supervised process -> health -> rollback.

    profiles.py     the profile file format and store; `Profile`, typed and parsed once
    plan.py         what `new` serves and how big (from sizing's report)
    manager.py      new, set (restart, health wait, rollback), start/stop/restart/rm, rows
    run.py          `macserve run NAME`: exec the profile's server (what a service runs), with
                    its secrets in the environment, back-off and launchd log rotation
    pull.py         download a hub model into the Hugging Face cache (only what it needs)
    doctor.py       do the services that start at login fit the GPU wired limit?
    preflight.py    multi-host checks over ssh before an mlx.launch group starts
    providers/      one module per server kind; each validates its own keys
    supervisors/    the Backend protocol; launchd (macOS) and supervisord (elsewhere); logs

Imports flow down: services -> sizing. Never the engine (its provider runs it as a process).
"""
