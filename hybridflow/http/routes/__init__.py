"""The HTTP routes, one router per concern: health probes, groups and calls, jobs, the
Open Inference Protocol and its extensions, the status page, login, and the API docs."""
