package postgres

import (
	"errors"
	"net/url"
	"strings"
	"testing"
)

func TestRedactDSN(t *testing.T) {
	for _, c := range []struct{ dsn, secret string }{
		{"postgres://app:Zq%zzS3cret@db:5432/shop", "S3cret"},
		{"postgres://app:p%40ss%2Fw0rd@db/shop", "ss/w0rd"},
		{"postgres://app:Pa@ss/w0rd@db/shop", "ss/w0rd"},
		{"postgres://app@db/shop?password=Qu3ry&sslmode=disable", "Qu3ry"},
		{"host=db user=app password=Kv5ecret dbname=shop", "Kv5ecret"},
		{"host=db user=app password = 'with sp4ce' dbname=shop", "sp4ce"},
	} {
		_, perr := url.Parse(c.dsn)
		for _, text := range []string{c.dsn, `parse "` + c.dsn + `": bad`, errors.Join(errors.New("x"), perr).Error(),
			strings.ReplaceAll(c.dsn, "%40", "@")} {
			if got := RedactDSN(text, c.dsn); strings.Contains(got, c.secret) {
				t.Errorf("RedactDSN(%q) = %q: the password shows", text, got)
			}
		}
	}
	if got := RedactDSN("connection refused", "postgres://app@db/shop"); got != "connection refused" {
		t.Errorf("without a password: %q", got)
	}
}
