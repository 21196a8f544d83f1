"""The web portal: server-rendered pages for people, with small live parts."""
