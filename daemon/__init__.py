"""daemon: the reputd service built on indexcore.

    config        YAML configuration, environment overrides, validation (ConfigError names the key)
    dispatchers   the Dispatcher protocol and the built-in ConsumeQueue and IndexFile dispatchers
    rebuild       the offline pipeline: CommitLog reader -> batches -> dispatchers -> flush
    query         queries by key, queue offset and msgId (read-only)
    inspect_file  decoding any store file for `reputd inspect`
    produce       sample messages for demos and load
    logs          structlog set-up
    cli           the `reputd` command line
"""
