"""replay_client: the client library (``ReplayClient``, ``Writer``, learner streams).

It talks to a replay server over gRPC and never imports ``replay_server``.
The network client is built by the service issue (#3); until then this
package holds nothing but its place in the layout.
"""
