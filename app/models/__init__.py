"""Qt-free models of what the window edits and shows; widgets in app/widgets mirror them."""
