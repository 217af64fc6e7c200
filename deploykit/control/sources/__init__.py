"""Sources of desired state: a git repository deploykit follows (``GitSource``). A source only produces
manifests; the live layer (``control.live``) makes them live exactly as it does a watched directory's."""
