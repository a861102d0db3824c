"""The engine `reputd run` and `reputd rebuild` share: recovery, the session, the CommitLog reader hand-off
(head, read-ahead), dispatch, the flusher and its checkpoint, the cleaner, the live reput loop and the
offline rebuild."""
