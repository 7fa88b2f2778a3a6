package outboxdriver

import (
	"context"
	"time"
)

// ServiceConfig is what a running service records of its configuration for the operator's
// tools: a cleanup started by hand refuses to forget message IDs sooner than the service would.
type ServiceConfig struct {
	Retention         time.Duration
	EffectRetention   time.Duration
	RedeliveryHorizon time.Duration
}

// ConfigRecorder is a Store that records the service's configuration. Outbox.Run records it
// before each cleanup pass.
type ConfigRecorder interface {
	RecordServiceConfig(ctx context.Context, c ServiceConfig) error
}
