"""The shell: everything that talks to Kubernetes (kopf handlers, watches, the API calls, leases, Events,
metrics). The core packages beside it decide; the shell reads the cluster, asks them, and writes back."""
