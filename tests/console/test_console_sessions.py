"""The console's session book, pure: sessions expire, close, stay bounded, and a CSRF token
matches only its own session."""

from __future__ import annotations

from tuneplane.coordinator.console.sessions import SessionBook


def test_a_session_expires_and_closes() -> None:
    book = SessionBook(lifetime_ms=1000)
    session = book.open("alice", "sha256:aa", now_ms=5000)
    assert book.find(session.session_id, 5999) == session
    assert book.find(session.session_id, 6000) is None
    again = book.open("alice", "sha256:aa", now_ms=7000)
    assert book.close(again.session_id) and book.find(again.session_id, 7001) is None
    assert not book.close(again.session_id)
    assert book.find("", 7001) is None and book.find("made-up", 7001) is None


def test_csrf_tokens_match_only_their_own_session() -> None:
    book = SessionBook(lifetime_ms=1000)
    one, two = book.open("alice", "h1", 0), book.open("alice", "h1", 0)
    assert one.session_id != two.session_id and one.csrf_token != two.csrf_token
    assert one.csrf_matches(one.csrf_token)
    assert not one.csrf_matches(two.csrf_token)
    assert not one.csrf_matches("")
    assert "h1" not in repr(one) and one.csrf_token not in repr(one)


def test_the_book_is_bounded_and_drops_the_first_to_expire() -> None:
    book = SessionBook(lifetime_ms=1000, max_sessions=3)
    first = book.open("a", "h", 0)
    later = [book.open("b", "h", t) for t in (10, 20, 30)]
    assert len(book) == 3
    assert book.find(first.session_id, 40) is None
    assert all(book.find(s.session_id, 40) == s for s in later)
