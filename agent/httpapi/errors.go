package httpapi

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// Error types, as OpenAI's API names them, carried in APIError.Type.
const (
	typeInvalidRequest = "invalid_request_error"
	typeNotFound       = "not_found_error"
	typeConflict       = "conflict_error"
	typeAuth           = "authentication_error"
	typeServer         = "server_error"
	typeJob            = "job_error"
)

// Stable error codes a client may switch on. Field errors use
// "invalid_<field>" (invalid_steps, invalid_size, ...).
const (
	CodeInvalidJSON        = "invalid_json"
	CodeUnknownField       = "unknown_field"
	CodeInvalidType        = "invalid_type"
	CodeBodyTooLarge       = "body_too_large"
	CodeUnsupportedMedia   = "unsupported_media_type"
	CodeUnsupportedFormat  = "unsupported_response_format"
	CodeMethodNotAllowed   = "method_not_allowed"
	CodeNotFound           = "not_found"
	CodeJobNotFound        = "job_not_found"
	CodeNotReady           = "not_ready"
	CodeAlreadyFinished    = "already_finished"
	CodeCancelled          = "cancelled"
	CodeJobFailed          = "job_failed"
	CodeTimeout            = "timeout"
	CodeUnauthorized       = "unauthorized"
	CodeRateLimited        = "rate_limited" // this token's request rate is used up; see Retry-After
	CodeUnavailable        = "unavailable"
	CodeOverloaded         = "overloaded" // the mesh cannot take more work now; retry later
	CodeExpired            = "expired"
	CodeResultLost         = "result_lost" // every copy of the result is gone before its retention ended
	CodeInternal           = "internal_error"
	codeInvalidFieldPrefix = "invalid_"
)

// APIError is the error body every endpoint writes,
// {"error":{"message","type","param","code"}}, and what Client returns
// for any non-2xx answer. Status is the HTTP status; it is not on the wire.
type APIError struct {
	Status  int    `json:"-"`
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"` // the request field at fault, when one is
	Code    string `json:"code"`
	// RetryAfter, when positive, is sent as a Retry-After header (seconds).
	RetryAfter int `json:"-"`
}

func (e *APIError) Error() string {
	if e.Code == "" {
		return fmt.Sprintf("httpapi: HTTP %d: %s", e.Status, e.Message)
	}
	return fmt.Sprintf("httpapi: HTTP %d: %s (%s)", e.Status, e.Message, e.Code)
}

// errorEnvelope is the wire wrapper around APIError.
type errorEnvelope struct {
	Error *APIError `json:"error"`
}

func apiErr(status int, typ, code, format string, a ...any) *APIError {
	return &APIError{Status: status, Type: typ, Code: code, Message: fmt.Sprintf(format, a...)}
}

func writeError(w http.ResponseWriter, e *APIError) {
	if e.RetryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	writeJSON(w, e.Status, errorEnvelope{Error: e})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		// Only a value we built can get here (an invalid Class, say);
		// answer with an error the client can still parse.
		status = http.StatusInternalServerError
		b, _ = json.Marshal(errorEnvelope{Error: apiErr(status, typeServer, CodeInternal, "encoding response: %v", err)})
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
