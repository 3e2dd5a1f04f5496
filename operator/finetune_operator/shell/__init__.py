"""The shell: everything that talks to Kubernetes (the process, the informers and their handlers, the
API calls, leases, Events, metrics). The core packages beside it decide; the shell reads the cluster,
asks them, and writes back."""
