package fastpath

import "reflect"

// deepEqual is reflect.DeepEqual for values without cycles (API objects are trees) and of the
// same type. reflect.DeepEqual allocates a map on every call to guard against cycles and adds
// every pointer, slice and map it passes to it: comparing a pod's containers field by field
// spent most of its time there (docs/benchmarks-webhook.md).
func deepEqual(a, b reflect.Value) bool {
	if !a.IsValid() || !b.IsValid() {
		return a.IsValid() == b.IsValid()
	}
	if a.Type() != b.Type() {
		return false
	}
	switch a.Kind() {
	case reflect.Struct:
		for i := range a.NumField() {
			if !deepEqual(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Pointer:
		if a.UnsafePointer() == b.UnsafePointer() {
			return true
		}
		return deepEqual(a.Elem(), b.Elem()) // a nil one's Elem is invalid: unequal
	case reflect.Slice:
		if a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		if a.UnsafePointer() == b.UnsafePointer() {
			return true
		}
		fallthrough
	case reflect.Array:
		for i := range a.Len() {
			if !deepEqual(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Map:
		if a.IsNil() != b.IsNil() || a.Len() != b.Len() {
			return false
		}
		if a.UnsafePointer() == b.UnsafePointer() {
			return true
		}
		for it := a.MapRange(); it.Next(); {
			v := b.MapIndex(it.Key())
			if !v.IsValid() || !deepEqual(it.Value(), v) {
				return false
			}
		}
		return true
	case reflect.Interface:
		if a.IsNil() || b.IsNil() {
			return a.IsNil() == b.IsNil()
		}
		return deepEqual(a.Elem(), b.Elem())
	case reflect.String:
		return a.String() == b.String()
	case reflect.Bool:
		return a.Bool() == b.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return a.Int() == b.Int()
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
		return a.Uint() == b.Uint()
	case reflect.Float32, reflect.Float64:
		return a.Float() == b.Float()
	case reflect.Complex64, reflect.Complex128:
		return a.Complex() == b.Complex()
	case reflect.Func:
		return a.IsNil() && b.IsNil()
	default: // channels, unsafe pointers: ==
		return a.UnsafePointer() == b.UnsafePointer()
	}
}

// equalValues is deepEqual of two values of the same type, given by pointers.
func equalValues[T any](a, b *T) bool {
	return deepEqual(reflect.ValueOf(a).Elem(), reflect.ValueOf(b).Elem())
}
