"""The extension points and the contract a plugin implements: hook specifications, the plugin
manager, the ``Library`` contract, op kinds, the configuration-space schema, the measuring
``Runner`` interface, and the behavioural suite every library passes (``checks``)."""
