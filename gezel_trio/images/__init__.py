"""Image generation: the plain data the image routes and the host's image lane share."""
