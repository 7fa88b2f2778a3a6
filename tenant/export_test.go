package tenant

// CachedHandlers counts the handlers member name of s keeps for the handlers wrapped by the
// Set's middleware.
func CachedHandlers(s *Set, name string) int {
	s.mu.Lock()
	m := s.members[name]
	s.mu.Unlock()
	if m == nil {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.wrapped)
}
