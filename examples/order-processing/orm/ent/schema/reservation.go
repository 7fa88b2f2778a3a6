// Package schema is the ent schema of the reservations table the handlers of package orm write.
package schema

import (
	"entgo.io/ent"
	"entgo.io/ent/dialect/entsql"
	"entgo.io/ent/schema"
	"entgo.io/ent/schema/field"
)

// Reservation is a row of the reservations table. The table has no id column of its own: ent's
// ID is the order's ID, stored as order_id.
type Reservation struct{ ent.Schema }

// Annotations names the table.
func (Reservation) Annotations() []schema.Annotation {
	return []schema.Annotation{entsql.Annotation{Table: "reservations"}}
}

// Fields of the reservations table.
func (Reservation) Fields() []ent.Field {
	return []ent.Field{
		field.String("id").StorageKey("order_id").Immutable(),
		field.String("sku"),
	}
}
