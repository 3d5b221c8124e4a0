"""What answers a request, under the daemon and the in-process client: the model library
(list, show, copy, delete, create, pull), residency (which models are loaded, keep-alive,
the scheduler of requests onto generators), request jobs and options, tool calls,
embeddings, log-probabilities and images of requests."""
